// Stub of the macOS SDK header, for tools/check_metal_host.sh only. As in the SDK on
// arm64 (OBJC_OLD_DISPATCH_PROTOTYPES=0), objc_msgSend is cast to the real signature.
#pragma once
#include <objc/runtime.h>

extern "C" void objc_msgSend(void);
