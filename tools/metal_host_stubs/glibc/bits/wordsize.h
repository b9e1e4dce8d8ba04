// Shim for tools/check_metal_host.sh, which compiles for arm64 macOS against the host's
// x86-64 glibc headers: their bits/wordsize.h would take a target without __x86_64__
// for a 32-bit one. Darwin arm64 is LP64.
#define __WORDSIZE 64
#define __WORDSIZE_TIME64_COMPAT32 1
#define __SYSCALL_WORDSIZE 64
