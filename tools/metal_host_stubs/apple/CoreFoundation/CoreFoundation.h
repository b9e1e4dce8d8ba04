// Stub of the macOS SDK header, for tools/check_metal_host.sh only: what metal-cpp
// uses from it. The real header also brings in <math.h> (metal-cpp uses INFINITY).
#pragma once
#include <math.h>

typedef double CFTimeInterval;
