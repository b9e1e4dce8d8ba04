// Shim for tools/check_metal_host.sh: glibc's x86-64 gnu/stubs.h includes this on a
// target without __x86_64__ (here arm64 Darwin). It lists unimplemented functions
// only; nothing needs it.
