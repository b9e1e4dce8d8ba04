// Stub of the macOS SDK header, for tools/check_metal_host.sh only.
#pragma once

typedef struct __IOSurface* IOSurfaceRef;
