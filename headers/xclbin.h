/*
 * xclbin.h -- the axlf ("xclbin2") container structs that amdxdna-direct reads.
 *
 * Mirrors: XRT src/runtime_src/core/include/xrt/detail/xclbin.h (XRT 2.17-2.19 era, with the
 * AIE_PARTITION section structs).  The structs that also exist in XRT 2022.1 (Debian libxrt-dev
 * 202210.2.13: axlf, axlf_header, axlf_section_header, mem_data, mem_topology, connection,
 * connectivity, ip_data, ip_layout) keep that version's layout, including its [1] trailing arrays
 * and anonymous unions, so sizeof agrees with it; the tests compare the two.
 *
 * Written for amdxdna-direct from docs/xrt-sequence.md section 3; not copied from XRT.
 * All integers little endian, natural alignment.  Requires <stdint.h>; parsed by cffi.
 */

enum XCLBIN_MODE {
    XCLBIN_FLAT = 0,
    XCLBIN_PR = 1,
    XCLBIN_TANDEM_STAGE2 = 2,
    XCLBIN_TANDEM_STAGE2_WITH_PR = 3,
    XCLBIN_HW_EMU = 4,
    XCLBIN_SW_EMU = 5,
    XCLBIN_HW_EMU_PR = 6,
    XCLBIN_MODE_MAX = 7
};

/* axlf_header.m_actionMask bits */
enum ACTION_MASK {
    AM_LOAD_AIE = 1,
    AM_LOAD_PDI = 2
};

enum axlf_section_kind {
    BITSTREAM = 0,
    CLEARING_BITSTREAM = 1,
    EMBEDDED_METADATA = 2,
    FIRMWARE = 3,
    DEBUG_DATA = 4,
    SCHED_FIRMWARE = 5,
    MEM_TOPOLOGY = 6,
    CONNECTIVITY = 7,
    IP_LAYOUT = 8,
    DEBUG_IP_LAYOUT = 9,
    DESIGN_CHECK_POINT = 10,
    CLOCK_FREQ_TOPOLOGY = 11,
    MCS = 12,
    BMC = 13,
    BUILD_METADATA = 14,
    KEYVALUE_METADATA = 15,
    USER_METADATA = 16,
    DNA_CERTIFICATE = 17,
    PDI = 18,
    BITSTREAM_PARTIAL_PDI = 19,
    PARTITION_METADATA = 20,
    EMULATION_DATA = 21,
    SYSTEM_METADATA = 22,
    SOFT_KERNEL = 23,
    ASK_FLASH = 24,
    AIE_METADATA = 25,
    ASK_GROUP_TOPOLOGY = 26,
    ASK_GROUP_CONNECTIVITY = 27,
    SMARTNIC = 28,
    AIE_RESOURCES = 29,
    OVERLAY = 30,
    VENDER_METADATA = 31,
    AIE_PARTITION = 32,
    IP_METADATA = 33,
    AIE_RESOURCES_BIN = 34,
    AIE_TRACE_METADATA = 35,
    DTBO = 36
};

/* ---- 3.1 / 3.2 file header and section table ---- */

struct axlf_section_header {
    uint32_t m_sectionKind;
    char m_sectionName[16];
    uint64_t m_sectionOffset;
    uint64_t m_sectionSize;
};

struct axlf_header {
    uint64_t m_length;
    uint64_t m_timeStamp;
    uint64_t m_featureRomTimeStamp;
    uint16_t m_versionPatch;
    uint8_t m_versionMajor;
    uint8_t m_versionMinor;
    uint16_t m_mode;
    uint16_t m_actionMask;
    /* newer XRT calls these 16 bytes m_interface_uuid */
    union {
        struct {
            uint64_t m_platformId;
            uint64_t m_featureId;
        } rom;
        unsigned char rom_uuid[16];
    };
    unsigned char m_platformVBNV[64];
    /* `uuid` is the xclbin uuid that xrt::xclbin::get_uuid() returns */
    union {
        char m_next_axlf[16];
        unsigned char uuid[16];
    };
    char m_debug_bin[16];
    uint32_t m_numSections;
};

struct axlf {
    char m_magic[8];
    int32_t m_signature_length;
    unsigned char reserved[28];
    unsigned char m_keyBlock[256];
    uint64_t m_uniqueId;
    struct axlf_header m_header;
    struct axlf_section_header m_sections[1];
};

/* ---- 3.4 MEM_TOPOLOGY / ASK_GROUP_TOPOLOGY ---- */

enum MEM_TYPE {
    MEM_DDR3 = 0,
    MEM_DDR4 = 1,
    MEM_DRAM = 2,
    MEM_STREAMING = 3,
    MEM_PREALLOCATED_GLOB = 4,
    MEM_ARE = 5,
    MEM_HBM = 6,
    MEM_BRAM = 7,
    MEM_URAM = 8,
    MEM_STREAMING_CONNECTION = 9,
    MEM_HOST = 10,
    MEM_PS_KERNEL = 11
};

struct mem_data {
    uint8_t m_type;
    uint8_t m_used;
    uint8_t padding[6];
    union {
        uint64_t m_size;
        uint64_t route_id;
    };
    union {
        uint64_t m_base_address;
        uint64_t flow_id;
    };
    unsigned char m_tag[16];
};

struct mem_topology {
    int32_t m_count;
    struct mem_data m_mem_data[1];
};

/* ---- 3.5 CONNECTIVITY / ASK_GROUP_CONNECTIVITY ---- */

struct connection {
    int32_t arg_index;
    int32_t m_ip_layout_index;
    int32_t mem_data_index;
};

struct connectivity {
    int32_t m_count;
    struct connection m_connection[1];
};

/* ---- 3.6 IP_LAYOUT ---- */

enum IP_TYPE {
    IP_MB = 0,
    IP_KERNEL = 1,
    IP_DNASC = 2,
    IP_DDR4_CONTROLLER = 3,
    IP_MEM_DDR4 = 4,
    IP_MEM_HBM = 5,
    IP_MEM_HBM_ECC = 6,
    IP_PS_KERNEL = 7
};

/* ip_data.properties of an IP_PS_KERNEL entry: field = (properties >> SHIFT) & MASK. */
#define IP_PS_KERNEL_SUBTYPE_SHIFT 0
#define IP_PS_KERNEL_SUBTYPE_MASK 0x3
#define IP_PS_KERNEL_FUNCTIONAL_SHIFT 4
#define IP_PS_KERNEL_FUNCTIONAL_MASK 0x3
#define IP_PS_KERNEL_KERNEL_ID_SHIFT 16
#define IP_PS_KERNEL_KERNEL_ID_MASK 0xfff

enum PS_SUBTYPE {
    ST_PS = 0,
    ST_DPU = 1
};

enum PS_FUNCTIONAL {
    FC_DPU = 0,
    FC_PREPOST = 1
};

struct ip_data {
    uint32_t m_type;
    union {
        uint32_t properties;
        struct {
            uint16_t m_index;
            uint8_t m_pc_index;
            uint8_t unused;
        } indices;
    };
    uint64_t m_base_address;
    uint8_t m_name[64];
};

struct ip_layout {
    int32_t m_count;
    struct ip_data m_ip_data[1];
};

/* ---- 3.8 AIE_PARTITION (kind 32) ---- */

/* A variable-length member: `size` elements at `offset` bytes from the start of the section. */
struct array_offset {
    uint32_t size;
    uint32_t offset;
};

enum CDO_TYPE {
    CT_UNKNOWN = 0,
    CT_PRIMARY = 1,
    CT_LITE = 2,
    CT_PREPOST = 3
};

/* mpo_name: section offset of a NUL-terminated string; dpu_kernel_ids holds uint64_t,
 * pre_cdo_groups uint32_t elements. */
struct cdo_group {
    uint32_t mpo_name;
    uint8_t cdo_type;
    uint8_t padding[3];
    uint64_t pdi_id;
    struct array_offset dpu_kernel_ids;
    struct array_offset pre_cdo_groups;
    uint8_t reserved[64];
};

/* pdi_image holds bytes, cdo_groups struct cdo_group elements. */
struct aie_pdi {
    unsigned char uuid[16];
    struct array_offset pdi_image;
    struct array_offset cdo_groups;
    uint8_t reserved[64];
};

/* start_columns holds uint16_t elements. */
struct aie_partition_info {
    uint16_t column_width;
    uint8_t padding[6];
    struct array_offset start_columns;
    uint8_t reserved[72];
};

/* mpo_name and kernel_commit_id are string offsets; aie_pdi holds struct aie_pdi elements. */
struct aie_partition {
    uint8_t schema_version;
    uint8_t padding0[3];
    uint32_t mpo_name;
    uint32_t operations_per_cycle;
    uint8_t padding[4];
    uint64_t inference_fingerprint;
    uint64_t pre_post_fingerprint;
    struct aie_partition_info info;
    struct array_offset aie_pdi;
    uint32_t kernel_commit_id;
    uint8_t reserved[52];
};
