// Stub of the macOS SDK header, for tools/check_metal_host.sh only: the types in
// MTL::Resource::setOwner.
#pragma once

typedef int kern_return_t;
typedef unsigned int mach_port_t;
typedef mach_port_t task_id_token_t;
