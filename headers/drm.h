/*
 * drm.h -- the subset of the DRM core uAPI that amdxdna-direct uses on /dev/accel/accelN.
 *
 * Mirrors: Linux include/uapi/drm/drm.h as shipped by libdrm 2.4.114 (Debian bookworm
 * libdrm-dev) and kernels 6.14-7.0, in its older (pre-deadline) layouts: drm_syncobj_wait is
 * 32 bytes and drm_syncobj_timeline_wait 40 bytes; newer kernels append deadline_nsec and accept
 * both sizes (docs/uapi.md section 5).
 *
 * Written for amdxdna-direct from docs/uapi.md section 5 and docs/uapi.md A.3;
 * not copied from the kernel or libdrm header.  x86_64 LP64 layout.
 *
 * Requires <stdint.h> and <stddef.h>; parsed by cffi, so no #include and only plain integer
 * #defines.  Request numbers are computed in amdxdna_direct/abi.py from these sizes.
 */

/* The ioctl type byte 'd' and the first driver-private nr. */
#define DRM_IOCTL_BASE 0x64
#define DRM_COMMAND_BASE 0x40

/*
 * Core ioctl nrs.  The kernel spells them inline in its DRM_IOxx() macros; they are named here
 * (project names, not kernel names) so that abi.py computes every request from the cdef.
 */
enum drm_core_ioctl_nr {
    DRM_NR_VERSION = 0x00,
    DRM_NR_GEM_CLOSE = 0x09,
    DRM_NR_GET_CAP = 0x0c,
    DRM_NR_PRIME_HANDLE_TO_FD = 0x2d,
    DRM_NR_PRIME_FD_TO_HANDLE = 0x2e,
    DRM_NR_SYNCOBJ_CREATE = 0xbf,
    DRM_NR_SYNCOBJ_DESTROY = 0xc0,
    DRM_NR_SYNCOBJ_WAIT = 0xc3,
    DRM_NR_SYNCOBJ_RESET = 0xc4,
    DRM_NR_SYNCOBJ_SIGNAL = 0xc5,
    DRM_NR_SYNCOBJ_TIMELINE_WAIT = 0xca,
    DRM_NR_SYNCOBJ_QUERY = 0xcb,
    DRM_NR_SYNCOBJ_TIMELINE_SIGNAL = 0xcd
};

/* GET_CAP capabilities */
#define DRM_CAP_SYNCOBJ 0x13
#define DRM_CAP_SYNCOBJ_TIMELINE 0x14

/* PRIME flags: O_RDWR and O_CLOEXEC of x86_64 Linux */
#define DRM_RDWR 2
#define DRM_CLOEXEC 0x80000

/* syncobj flags */
#define DRM_SYNCOBJ_CREATE_SIGNALED 1
#define DRM_SYNCOBJ_WAIT_FLAGS_WAIT_ALL 1
#define DRM_SYNCOBJ_WAIT_FLAGS_WAIT_FOR_SUBMIT 2
#define DRM_SYNCOBJ_WAIT_FLAGS_WAIT_AVAILABLE 4
#define DRM_SYNCOBJ_WAIT_FLAGS_WAIT_DEADLINE 8
#define DRM_SYNCOBJ_QUERY_FLAGS_LAST_SUBMITTED 1

struct drm_version {
    int version_major;
    int version_minor;
    int version_patchlevel;
    size_t name_len;
    char *name;
    size_t date_len;
    char *date;
    size_t desc_len;
    char *desc;
};

struct drm_gem_close {
    uint32_t handle;
    uint32_t pad;
};

struct drm_get_cap {
    uint64_t capability;
    uint64_t value;
};

struct drm_prime_handle {
    uint32_t handle;
    uint32_t flags;
    int32_t fd;
};

struct drm_syncobj_create {
    uint32_t handle;
    uint32_t flags;
};

struct drm_syncobj_destroy {
    uint32_t handle;
    uint32_t pad;
};

/* timeout_nsec is an absolute CLOCK_MONOTONIC time (docs/uapi.md section 5). */
struct drm_syncobj_wait {
    uint64_t handles;
    int64_t timeout_nsec;
    uint32_t count_handles;
    uint32_t flags;
    uint32_t first_signaled;
    uint32_t pad;
};

struct drm_syncobj_timeline_wait {
    uint64_t handles;
    uint64_t points;
    int64_t timeout_nsec;
    uint32_t count_handles;
    uint32_t flags;
    uint32_t first_signaled;
    uint32_t pad;
};

struct drm_syncobj_array {
    uint64_t handles;
    uint32_t count_handles;
    uint32_t pad;
};

struct drm_syncobj_timeline_array {
    uint64_t handles;
    uint64_t points;
    uint32_t count_handles;
    uint32_t flags;
};
