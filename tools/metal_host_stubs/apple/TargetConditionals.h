// Stub of the macOS SDK header, for tools/check_metal_host.sh only: clang predefines
// the TARGET_OS_* macros for an apple target.
#pragma once
