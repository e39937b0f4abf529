/*
 * ert.h -- the command-packet ("ERT") format that amdxdna reads from CMD buffer objects.
 *
 * Mirrors: XRT src/runtime_src/core/include/xrt/detail/ert.h (XRT 2.17-2.19 era, the version
 * with ERT_START_NPU / ERT_CMD_CHAIN) and the kernel's drivers/accel/amdxdna/amdxdna_ctx.h
 * (Linux 7.0).  Older names and values (opcodes 0-17, states, types) agree with XRT 2022.1
 * (Debian libxrt-dev 202210.2.13), which the tests compare against.
 *
 * Written for amdxdna-direct from docs/xrt-sequence.md section 1.7 and
 * docs/uapi.md sections 3 and 6; not copied from XRT or the kernel.
 *
 * The header word is a plain uint32_t here; its bit fields are given as shift + (unshifted)
 * mask pairs: field = (header >> X_SHIFT) & X_MASK.  Requires <stdint.h>; parsed by cffi.
 */

/* Header word bit fields (docs/uapi.md 6.1, docs/xrt-sequence.md 1.7). */
#define ERT_HDR_STATE_SHIFT 0
#define ERT_HDR_STATE_MASK 0xf
#define ERT_HDR_STAT_ENABLED_SHIFT 4
#define ERT_HDR_STAT_ENABLED_MASK 0x1
/* bits 11:4 taken as one field by the generic packet; START_CU splits them */
#define ERT_HDR_CUSTOM_SHIFT 4
#define ERT_HDR_CUSTOM_MASK 0xff
#define ERT_HDR_UNUSED_SHIFT 5
#define ERT_HDR_UNUSED_MASK 0x1f
#define ERT_HDR_EXTRA_CU_MASKS_SHIFT 10
#define ERT_HDR_EXTRA_CU_MASKS_MASK 0x3
#define ERT_HDR_COUNT_SHIFT 12
#define ERT_HDR_COUNT_MASK 0x7ff
#define ERT_HDR_OPCODE_SHIFT 23
#define ERT_HDR_OPCODE_MASK 0x1f
#define ERT_HDR_TYPE_SHIFT 28
#define ERT_HDR_TYPE_MASK 0xf

enum ert_cmd_state {
    ERT_CMD_STATE_INVALID = 0,
    ERT_CMD_STATE_NEW = 1,
    ERT_CMD_STATE_QUEUED = 2,
    ERT_CMD_STATE_RUNNING = 3,
    ERT_CMD_STATE_COMPLETED = 4,
    ERT_CMD_STATE_ERROR = 5,
    ERT_CMD_STATE_ABORT = 6,
    ERT_CMD_STATE_SUBMITTED = 7,
    ERT_CMD_STATE_TIMEOUT = 8,
    ERT_CMD_STATE_NORESPONSE = 9,
    ERT_CMD_STATE_SKERROR = 10,
    ERT_CMD_STATE_SKCRASHED = 11,
    ERT_CMD_STATE_MAX = 12
};

enum ert_cmd_opcode {
    ERT_START_CU = 0,
    ERT_START_KERNEL = 0,
    ERT_CONFIGURE = 2,
    ERT_EXIT = 3,
    ERT_ABORT = 4,
    ERT_EXEC_WRITE = 5,
    ERT_CU_STAT = 6,
    ERT_START_COPYBO = 7,
    ERT_SK_CONFIG = 8,
    ERT_SK_START = 9,
    ERT_SK_UNCONFIG = 10,
    ERT_INIT_CU = 11,
    ERT_START_FA = 12,
    ERT_CLK_CALIB = 13,
    ERT_MB_VALIDATE = 14,
    ERT_START_KEY_VAL = 15,
    ERT_ACCESS_TEST_C = 16,
    ERT_ACCESS_TEST = 17,
    ERT_START_DPU = 18,
    ERT_CMD_CHAIN = 19,
    ERT_START_NPU = 20,
    ERT_START_NPU_PREEMPT = 21,
    ERT_START_NPU_PREEMPT_ELF = 22
};

enum ert_cmd_type {
    ERT_DEFAULT = 0,
    ERT_KDS_LOCAL = 1,
    ERT_CTRL = 2,
    ERT_CU = 3,
    ERT_SCU = 4
};

/* Any packet: header, then `count` payload words. */
struct ert_packet {
    uint32_t header;
    uint32_t data[1];
};

/*
 * ERT_START_CU (and the START_NPU family): header, the mandatory CU mask, extra_cu_masks
 * further masks, then the payload (regmap, or an ert_npu_data for START_NPU).
 */
struct ert_start_kernel_cmd {
    uint32_t header;
    union {
        uint32_t cu_mask;
        int32_t return_code;
    };
    uint32_t data[1];
};

/* ERT_START_NPU payload after the CU mask(s) (docs/uapi.md 6.3). */
struct ert_npu_data {
    uint64_t instruction_buffer;
    uint32_t instruction_buffer_size;
    uint32_t instruction_prop_count;
    uint32_t data[];
};

/* ERT_START_NPU_PREEMPT / _PREEMPT_ELF payload after the CU mask(s) (6.4). */
struct ert_npu_preempt_data {
    uint64_t instruction_buffer;
    uint64_t save_buffer;
    uint64_t restore_buffer;
    uint32_t instruction_buffer_size;
    uint32_t save_buffer_size;
    uint32_t restore_buffer_size;
    uint32_t instruction_prop_count;
    uint32_t data[];
};

/*
 * ERT_CMD_CHAIN payload (no CU mask).  amdxdna takes data[i] as the GEM handle of the i-th
 * sub-command BO (low 32 bits), not as an address (docs/uapi.md 6.5).
 */
struct ert_cmd_chain_data {
    uint32_t command_count;
    uint32_t submit_index;
    uint32_t error_index;
    uint32_t reserved[3];
    uint64_t data[];
};
