// Stub of the macOS SDK header, for tools/check_metal_host.sh only: the opaque
// dispatch types named in metal-cpp's declarations.
#pragma once

typedef struct dispatch_queue_s* dispatch_queue_t;
typedef struct dispatch_data_s* dispatch_data_t;
