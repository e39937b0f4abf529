/*
 * libc.h -- the few libc entry points and constants the syscall seam needs (mapping buffer
 * objects and reserving the 64 MiB-aligned heap window, docs/uapi.md section 7).
 *
 * Mirrors: glibc 2.36 <sys/mman.h> on x86_64 Linux (Debian bookworm); the MAP_ values are the
 * x86 ones (asm-generic/mman-common.h, arch/x86 mman.h).  off_t is `long` on LP64.
 *
 * Written for amdxdna-direct; not copied from glibc.  Requires <stddef.h>; parsed by cffi.
 */

#define PROT_NONE 0
#define PROT_READ 1
#define PROT_WRITE 2
#define PROT_EXEC 4

#define MAP_SHARED 1
#define MAP_PRIVATE 2
#define MAP_FIXED 0x10
#define MAP_ANONYMOUS 0x20
#define MAP_LOCKED 0x2000
#define MAP_NORESERVE 0x4000
#define MAP_POPULATE 0x8000
#define MAP_FIXED_NOREPLACE 0x100000

void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset);
int munmap(void *addr, size_t length);
