/*
 * amdxdna_accel.h -- the amdxdna accel driver uAPI, as seen by amdxdna-direct.
 *
 * Mirrors: Linux include/uapi/drm/amdxdna_accel.h at torvalds/linux 637315cb (2026, DRM driver
 * version 0.10: eleven ioctls incl. WAIT_CMD and GET_ARRAY), plus the staging/out-of-tree
 * (amd/xdna-driver 856409ca) additions listed in docs/uapi.md A.1-A.2 (hwctx_entry with
 * name[16] = 160 bytes, coredump, tile access, debug trace, firmware buffer metadata).
 * amdxdna_qos_info is the 24-byte upstream layout (the OOT driver reads 32 bytes, see
 * docs/uapi.md section 12).
 *
 * Written for amdxdna-direct from the facts in docs/uapi.md sections 1-3 and
 * docs/uapi.md A.1-A.2; not copied from the kernel header.  x86_64 LP64 layout.
 *
 * Requires <stdint.h> (and nothing else); parsed by cffi, so no #include and only plain
 * integer #defines.
 */

/* ---- invalid handle / address sentinels (docs/uapi.md section 3) ---- */
#define AMDXDNA_INVALID_CMD_HANDLE 0xffffffffffffffff
#define AMDXDNA_INVALID_ADDR 0xffffffffffffffff
#define AMDXDNA_INVALID_CTX_HANDLE 0
#define AMDXDNA_INVALID_BO_HANDLE 0
#define AMDXDNA_INVALID_FENCE_HANDLE 0
#define AMDXDNA_INVALID_DOORBELL_OFFSET 0xffffffff

/* QoS priority values of amdxdna_qos_info.priority (driver minor 0.6). */
#define AMDXDNA_QOS_REALTIME_PRIORITY 0x100
#define AMDXDNA_QOS_HIGH_PRIORITY 0x180
#define AMDXDNA_QOS_NORMAL_PRIORITY 0x200
#define AMDXDNA_QOS_LOW_PRIORITY 0x280

/* amdxdna_drm_sync_bo.direction */
#define SYNC_DIRECT_TO_DEVICE 0
#define SYNC_DIRECT_FROM_DEVICE 1

/* amdxdna_drm_hwctx_entry.state */
#define AMDXDNA_HWCTX_STATE_IDLE 0
#define AMDXDNA_HWCTX_STATE_ACTIVE 1
#define AMDXDNA_HWCTX_PROC_NAME_LEN 16

/* Out-of-tree GET_ARRAY limits. */
#define AMDXDNA_MAX_ELEMENT_SIZE 104857600
#define AMDXDNA_MAX_NUM_ELEMENT 1024

enum amdxdna_device_type {
    AMDXDNA_DEV_TYPE_UNKNOWN = -1,
    AMDXDNA_DEV_TYPE_KMQ = 0,
    AMDXDNA_DEV_TYPE_UMQ = 1,
    AMDXDNA_DEV_TYPE_PF = 2
};

/* Ioctl indices; the request nr is DRM_COMMAND_BASE + index (docs/uapi.md section 1a). */
enum amdxdna_drm_ioctl_id {
    DRM_AMDXDNA_CREATE_HWCTX = 0,
    DRM_AMDXDNA_DESTROY_HWCTX = 1,
    DRM_AMDXDNA_CONFIG_HWCTX = 2,
    DRM_AMDXDNA_CREATE_BO = 3,
    DRM_AMDXDNA_GET_BO_INFO = 4,
    DRM_AMDXDNA_SYNC_BO = 5,
    DRM_AMDXDNA_EXEC_CMD = 6,
    DRM_AMDXDNA_GET_INFO = 7,
    DRM_AMDXDNA_SET_STATE = 8,
    DRM_AMDXDNA_WAIT_CMD = 9,
    DRM_AMDXDNA_GET_ARRAY = 10
};

/* ---- 2.1 hardware contexts ---- */

struct amdxdna_qos_info {
    uint32_t gops;
    uint32_t fps;
    uint32_t dma_bandwidth;
    uint32_t latency;
    uint32_t frame_exec_time;
    uint32_t priority;
};

struct amdxdna_drm_create_hwctx {
    uint64_t ext;
    uint64_t ext_flags;
    uint64_t qos_p;
    uint32_t umq_bo;
    uint32_t log_buf_bo;
    uint32_t max_opc;
    uint32_t num_tiles;
    uint32_t mem_size;
    uint32_t umq_doorbell;
    uint32_t handle;
    uint32_t syncobj_handle;
};

struct amdxdna_drm_destroy_hwctx {
    uint32_t handle;
    uint32_t pad;
};

struct amdxdna_cu_config {
    uint32_t cu_bo;
    uint8_t cu_func;
    uint8_t pad[3];
};

struct amdxdna_hwctx_param_config_cu {
    uint16_t num_cus;
    uint16_t pad[3];
    struct amdxdna_cu_config cu_configs[];
};

enum amdxdna_drm_config_hwctx_param {
    DRM_AMDXDNA_HWCTX_CONFIG_CU = 0,
    DRM_AMDXDNA_HWCTX_ASSIGN_DBG_BUF = 1,
    DRM_AMDXDNA_HWCTX_REMOVE_DBG_BUF = 2
};

/* Staging/OOT: an AIE4 debug buffer may carry this metadata. */
struct amdxdna_uc_info_entry {
    uint32_t index;
    uint32_t size;
};

struct amdxdna_fw_buffer_metadata {
    uint8_t buf_type;
    uint8_t num_ucs;
    uint8_t pad[2];
    uint32_t bo_handle;
    uint64_t command_id;
    struct amdxdna_uc_info_entry uc_info[];
};

struct amdxdna_drm_config_hwctx {
    uint32_t handle;
    uint32_t param_type;
    uint64_t param_val;
    uint32_t param_val_size;
    uint32_t pad;
};

/* ---- 2.2 buffer objects ---- */

enum amdxdna_bo_type {
    AMDXDNA_BO_INVALID = 0,
    AMDXDNA_BO_SHMEM = 1,
    AMDXDNA_BO_SHARE = 1,
    AMDXDNA_BO_DEV_HEAP = 2,
    AMDXDNA_BO_DEV = 3,
    AMDXDNA_BO_CMD = 4
};

struct amdxdna_drm_va_entry {
    uint64_t vaddr;
    uint64_t len;
};

struct amdxdna_drm_va_tbl {
    int32_t dmabuf_fd;
    uint32_t num_entries;
    struct amdxdna_drm_va_entry va_entries[];
};

struct amdxdna_drm_create_bo {
    uint64_t flags;
    uint64_t vaddr;
    uint64_t size;
    uint32_t type;
    uint32_t handle;
};

struct amdxdna_drm_get_bo_info {
    uint64_t ext;
    uint64_t ext_flags;
    uint32_t handle;
    uint32_t pad;
    uint64_t map_offset;
    uint64_t vaddr;
    uint64_t xdna_addr;
};

struct amdxdna_drm_sync_bo {
    uint32_t handle;
    uint32_t direction;
    uint64_t offset;
    uint64_t size;
};

/* ---- 2.3 execution ---- */

enum amdxdna_cmd_type {
    AMDXDNA_CMD_SUBMIT_EXEC_BUF = 0,
    AMDXDNA_CMD_SUBMIT_DEPENDENCY = 1,
    AMDXDNA_CMD_SUBMIT_SIGNAL = 2
};

struct amdxdna_drm_exec_cmd {
    uint64_t ext;
    uint64_t ext_flags;
    uint32_t hwctx;
    uint32_t type;
    uint64_t cmd_handles;
    uint64_t args;
    uint32_t cmd_count;
    uint32_t arg_count;
    uint64_t seq;
};

struct amdxdna_drm_wait_cmd {
    uint32_t hwctx;
    uint32_t timeout;
    uint64_t seq;
};

/* ---- 2.5 GET_INFO payloads ---- */

struct amdxdna_drm_query_aie_status {
    uint64_t buffer;
    uint32_t buffer_size;
    uint32_t cols_filled;
};

struct amdxdna_drm_query_aie_version {
    uint32_t major;
    uint32_t minor;
};

struct amdxdna_drm_query_aie_tile_metadata {
    uint16_t row_count;
    uint16_t row_start;
    uint16_t dma_channel_count;
    uint16_t lock_count;
    uint16_t event_reg_count;
    uint16_t pad[3];
};

struct amdxdna_drm_query_aie_metadata {
    uint32_t col_size;
    uint16_t cols;
    uint16_t rows;
    struct amdxdna_drm_query_aie_version version;
    struct amdxdna_drm_query_aie_tile_metadata core;
    struct amdxdna_drm_query_aie_tile_metadata mem;
    struct amdxdna_drm_query_aie_tile_metadata shim;
};

struct amdxdna_drm_query_clock {
    uint8_t name[16];
    uint32_t freq_mhz;
    uint32_t pad;
};

struct amdxdna_drm_query_clock_metadata {
    struct amdxdna_drm_query_clock mp_npu_clock;
    struct amdxdna_drm_query_clock h_clock;
};

enum amdxdna_sensor_type {
    AMDXDNA_SENSOR_TYPE_POWER = 0,
    AMDXDNA_SENSOR_TYPE_COLUMN_UTILIZATION = 1
};

struct amdxdna_drm_query_sensor {
    uint8_t label[64];
    uint32_t input;
    uint32_t max;
    uint32_t average;
    uint32_t highest;
    uint8_t status[64];
    uint8_t units[16];
    int8_t unitm;
    uint8_t type;
    uint8_t pad[6];
};

struct amdxdna_drm_query_hwctx {
    uint32_t context_id;
    uint32_t start_col;
    uint32_t num_col;
    uint32_t pad;
    int64_t pid;
    uint64_t command_submissions;
    uint64_t command_completions;
    uint64_t migrations;
    uint64_t preemptions;
    uint64_t errors;
};

enum amdxdna_power_mode_type {
    POWER_MODE_DEFAULT = 0,
    POWER_MODE_LOW = 1,
    POWER_MODE_MEDIUM = 2,
    POWER_MODE_HIGH = 3,
    POWER_MODE_TURBO = 4
};

struct amdxdna_drm_get_power_mode {
    uint8_t power_mode;
    uint8_t pad[7];
};

struct amdxdna_drm_query_firmware_version {
    uint32_t major;
    uint32_t minor;
    uint32_t patch;
    uint32_t build;
};

struct amdxdna_drm_get_resource_info {
    uint64_t npu_clk_max;
    uint64_t npu_tops_max;
    uint64_t npu_task_max;
    uint64_t npu_tops_curr;
    uint64_t npu_task_curr;
};

struct amdxdna_drm_attribute_state {
    uint8_t state;
    uint8_t pad[7];
};

struct amdxdna_drm_query_telemetry_header {
    uint32_t major;
    uint32_t minor;
    uint32_t type;
    uint32_t map_num_elements;
    uint32_t map[];
};

/* GET_INFO params (docs/uapi.md section 3; 6 and 7 are OOT-only READ_AIE_MEM/REG). */
enum amdxdna_drm_get_param {
    DRM_AMDXDNA_QUERY_AIE_STATUS = 0,
    DRM_AMDXDNA_QUERY_AIE_METADATA = 1,
    DRM_AMDXDNA_QUERY_AIE_VERSION = 2,
    DRM_AMDXDNA_QUERY_CLOCK_METADATA = 3,
    DRM_AMDXDNA_QUERY_SENSORS = 4,
    DRM_AMDXDNA_QUERY_HW_CONTEXTS = 5,
    DRM_AMDXDNA_QUERY_FIRMWARE_VERSION = 8,
    DRM_AMDXDNA_GET_POWER_MODE = 9,
    DRM_AMDXDNA_QUERY_TELEMETRY = 10,
    DRM_AMDXDNA_GET_FORCE_PREEMPT_STATE = 11,
    DRM_AMDXDNA_QUERY_RESOURCE_INFO = 12,
    DRM_AMDXDNA_GET_FRAME_BOUNDARY_PREEMPT_STATE = 13
};

struct amdxdna_drm_get_info {
    uint32_t param;
    uint32_t buffer_size;
    uint64_t buffer;
};

/* ---- GET_ARRAY payloads ---- */

/* GET_ARRAY params (upstream values; 1, 3-5, 7-9 are staging/OOT only). */
enum amdxdna_drm_get_array_param {
    DRM_AMDXDNA_HW_CONTEXT_ALL = 0,
    DRM_AMDXDNA_HW_LAST_ASYNC_ERR = 2,
    DRM_AMDXDNA_BO_USAGE = 6
};

/* 160 bytes: the staging/OOT layout with the process name (mainline stops at pad, 144). */
struct amdxdna_drm_hwctx_entry {
    uint32_t context_id;
    uint32_t start_col;
    uint32_t num_col;
    uint32_t hwctx_id;
    int64_t pid;
    uint64_t command_submissions;
    uint64_t command_completions;
    uint64_t migrations;
    uint64_t preemptions;
    uint64_t errors;
    uint64_t priority;
    uint64_t heap_usage;
    uint64_t suspensions;
    uint32_t state;
    uint32_t pasid;
    uint32_t gops;
    uint32_t fps;
    uint32_t dma_bandwidth;
    uint32_t latency;
    uint32_t frame_exec_time;
    uint32_t txn_op_idx;
    uint32_t ctx_pc;
    uint32_t fatal_error_type;
    uint32_t fatal_error_exception_type;
    uint32_t fatal_error_exception_pc;
    uint32_t fatal_error_app_module;
    uint32_t pad;
    char name[16];
};

struct amdxdna_async_error {
    uint64_t err_code;
    uint64_t ts_us;
    uint64_t ex_err_code;
};

struct amdxdna_drm_bo_usage {
    int64_t pid;
    uint64_t total_usage;
    uint64_t internal_usage;
    uint64_t heap_usage;
};

/* Staging/OOT debug payloads. */
struct amdxdna_drm_aie_coredump {
    uint64_t pid;
    uint32_t context_id;
    uint32_t pad;
};

struct amdxdna_drm_aie_tile_access {
    uint64_t pid;
    uint32_t context_id;
    uint32_t col;
    uint32_t row;
    uint32_t addr;
    uint32_t size;
    uint8_t type;
    uint8_t pad[3];
};

struct amdxdna_dpt_metadata {
    uint64_t offset;
    uint32_t size;
    uint8_t watch;
    uint8_t pad[3];
};

struct amdxdna_drm_set_dpt_state {
    uint32_t action;
    uint32_t config;
    uint64_t pad;
};

struct amdxdna_drm_get_dpt_state {
    uint32_t version;
    uint32_t status;
    uint32_t config;
    uint32_t pad;
};

struct amdxdna_drm_get_array {
    uint32_t param;
    uint32_t element_size;
    uint32_t num_element;
    uint32_t pad;
    uint64_t buffer;
};

/* ---- SET_STATE ---- */

enum amdxdna_drm_set_param {
    DRM_AMDXDNA_SET_POWER_MODE = 0,
    DRM_AMDXDNA_WRITE_AIE_MEM = 1,
    DRM_AMDXDNA_WRITE_AIE_REG = 2,
    DRM_AMDXDNA_SET_FORCE_PREEMPT = 3,
    DRM_AMDXDNA_SET_FRAME_BOUNDARY_PREEMPT = 4
};

struct amdxdna_drm_set_state {
    uint32_t param;
    uint32_t buffer_size;
    uint64_t buffer;
};

struct amdxdna_drm_set_power_mode {
    uint8_t power_mode;
    uint8_t pad[7];
};
