/* What the loaded ggml's tensor really looks like, found through ggml's public calls alone, so
 * that graphdraw.c and q0swap.c (which read and write ggml's tensors through ggml_abi.h's copy
 * of the struct) run only where that copy is right (native_fence.py compares the two).
 *
 * Why: a struct copied from one llama.cpp is silently wrong in another. The size of the tensor
 * can stay the same while fields and operation numbers move (llama-cpp-python 0.3.30: the same
 * size, GGML_OP_CUSTOM 91 where 0.3.36 has 95), and a wrong offset turns into wrong tokens, not
 * a crash. So every field those files touch is located here from values ggml itself put there:
 * a tensor made with known dimensions, a view at a known offset, a matmul of two known tensors,
 * a custom operation with known parameters, a buffer ggml allocated; each value is searched for
 * in the tensor's bytes and its offset reported. Small numbers (types, operations) are read at
 * the declared offset and named by ggml (ggml_type_name, ggml_op_name, ggml_op_desc).
 */

#include <dlfcn.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "ggml_abi.h"

/* The facts, in the order ls_abi_probe and ls_abi_declared write them (native_fence.py's
 * FACTS names them). */
enum {
    F_OBJECT_BYTES,   /* ggml_object before each tensor in a context */
    F_TENSOR_BYTES,   /* ggml_tensor itself */
    F_TYPE,           /* offset of type */
    F_BUFFER,         /* of buffer */
    F_NE,             /* of ne[4] */
    F_NB,             /* of nb[4] */
    F_OP,             /* of op */
    F_OP_PARAMS,      /* of op_params */
    F_SRC,            /* of src[] */
    F_MAX_SRC,        /* src[]'s length */
    F_VIEW_SRC,       /* of view_src */
    F_VIEW_OFFS,      /* of view_offs */
    F_DATA,           /* of data */
    F_NAME,           /* of name[] */
    F_MAX_NAME,       /* name[]'s length */
    F_EXTRA,          /* of extra (NULL in a fresh tensor) */
    F_OP_MUL_MAT,     /* GGML_OP_MUL_MAT's number */
    F_OP_CUSTOM,      /* GGML_OP_CUSTOM's number */
    F_CUSTOM_TASKS,   /* offset of n_tasks in a custom operation's parameters */
    F_CUSTOM_DATA,    /* of userdata there */
    F_TYPES,          /* 1 where each type number ggml_abi.h names is that type in ggml */
    F_BUFFER_IS_HOST, /* 1 where ggml calls the CPU's buffer host memory */
    F_COUNT
};

typedef void (*free_fn)(void *);
typedef struct ggml_tensor *(*new_2d_fn)(void *, int, int64_t, int64_t);
typedef struct ggml_tensor *(*binary_fn)(void *, struct ggml_tensor *, struct ggml_tensor *);
typedef struct ggml_tensor *(*view_1d_fn)(void *, struct ggml_tensor *, int64_t, size_t);
typedef struct ggml_tensor *(*custom_4d_fn)(void *, int, int64_t, int64_t, int64_t, int64_t,
                                             struct ggml_tensor **, int, void *, int, void *);
typedef const char *(*name_of_fn)(int);
typedef const char *(*tensor_text_fn)(const struct ggml_tensor *);
typedef struct ggml_tensor *(*set_name_fn)(struct ggml_tensor *, const char *);
typedef void *(*tensor_data_fn)(const struct ggml_tensor *);
typedef size_t (*overhead_fn)(void);
typedef void *(*buft_fn)(void);
typedef void *(*alloc_tensors_fn)(void *, void *);
typedef bool (*is_host_fn)(void *);

/* ggml's init takes its parameters by value: a struct of three fields. */
struct init_params {
    size_t mem_size;
    void *mem_buffer;
    bool no_alloc;
};
typedef struct ggml_context *(*init_by_value_fn)(struct init_params);

/* Where `value` (of `size` bytes, at an offset that is a multiple of `align`) first sits in
 * the tensor at or after `from`; -1 where it does not. */
static int64_t find(const struct ggml_tensor *t, size_t tensor_bytes, int64_t from,
                    const void *value, size_t size, size_t align) {
    const char *bytes = (const char *)t;
    size_t at = from < 0 ? 0 : (size_t)from;
    for (at += (align - at % align) % align; at + size <= tensor_bytes; at += align)
        if (memcmp(bytes + at, value, size) == 0) return (int64_t)at;
    return -1;
}

static int64_t read_int(const struct ggml_tensor *t, int64_t offset) {
    int value;
    memcpy(&value, (const char *)t + offset, sizeof value);
    return value;
}

/* The custom operation the probe builds: never computed. */
static void never_run(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)dst, (void)ith, (void)nth, (void)userdata;
}

/* Fills found[0..F_COUNT) from the ggml at ggml_base (loaded already by llama.cpp); each entry
 * -1 where it could not be found. Returns F_COUNT, or 0 where a call is missing. */
int64_t ls_abi_probe(const char *ggml_base, int64_t *found) {
    for (int i = 0; i < F_COUNT; i++) found[i] = -1;
    void *lib = dlopen(ggml_base, RTLD_NOW);
    if (!lib) return 0;
    init_by_value_fn init = (init_by_value_fn)dlsym(lib, "ggml_init");
    free_fn ctx_free = (free_fn)dlsym(lib, "ggml_free");
    new_2d_fn new_2d = (new_2d_fn)dlsym(lib, "ggml_new_tensor_2d");
    binary_fn mul_mat = (binary_fn)dlsym(lib, "ggml_mul_mat");
    view_1d_fn view_1d = (view_1d_fn)dlsym(lib, "ggml_view_1d");
    custom_4d_fn custom_4d = (custom_4d_fn)dlsym(lib, "ggml_custom_4d");
    name_of_fn op_name = (name_of_fn)dlsym(lib, "ggml_op_name");
    name_of_fn type_name = (name_of_fn)dlsym(lib, "ggml_type_name");
    tensor_text_fn op_desc = (tensor_text_fn)dlsym(lib, "ggml_op_desc");
    set_name_fn set_name = (set_name_fn)dlsym(lib, "ggml_set_name");
    tensor_text_fn get_name = (tensor_text_fn)dlsym(lib, "ggml_get_name");
    tensor_data_fn get_data = (tensor_data_fn)dlsym(lib, "ggml_get_data");
    overhead_fn overhead = (overhead_fn)dlsym(lib, "ggml_tensor_overhead");
    buft_fn cpu_buft = (buft_fn)dlsym(lib, "ggml_backend_cpu_buffer_type");
    alloc_tensors_fn alloc_tensors =
        (alloc_tensors_fn)dlsym(lib, "ggml_backend_alloc_ctx_tensors_from_buft");
    free_fn buffer_free = (free_fn)dlsym(lib, "ggml_backend_buffer_free");
    is_host_fn buffer_is_host = (is_host_fn)dlsym(lib, "ggml_backend_buffer_is_host");
    if (!init || !ctx_free || !new_2d || !mul_mat || !view_1d || !custom_4d || !op_name ||
        !type_name || !op_desc || !set_name || !get_name || !get_data || !overhead ||
        !cpu_buft || !alloc_tensors || !buffer_free || !buffer_is_host)
        return 0;

    /* A context on our own memory: its first tensor follows one ggml_object. */
    static _Alignas(64) char memory[64 * 1024];
    struct init_params params = {sizeof memory, memory, true};
    void *ctx = init(params);
    if (!ctx) return 0;
    const int64_t ne0 = 933, ne1 = 7; /* dimensions no other field holds */
    struct ggml_tensor *a = new_2d(ctx, GGML_TYPE_F32, ne0, ne1);
    struct ggml_tensor *b = new_2d(ctx, GGML_TYPE_F32, ne0, 3);
    found[F_OBJECT_BYTES] = (char *)a - memory;
    size_t tensor_bytes = overhead() - (size_t)found[F_OBJECT_BYTES];
    found[F_TENSOR_BYTES] = (int64_t)tensor_bytes;
    /* Never read past what ggml's tensor and ours both hold. */
    if (tensor_bytes > sizeof(struct ggml_tensor)) tensor_bytes = sizeof(struct ggml_tensor);

    int64_t ne[4] = {ne0, ne1, 1, 1};
    size_t nb[4] = {sizeof(float), ne0 * sizeof(float), ne0 * ne1 * sizeof(float),
                    ne0 * ne1 * sizeof(float)};
    found[F_NE] = find(a, tensor_bytes, 0, ne, sizeof ne, 8);
    found[F_NB] = find(a, tensor_bytes, 0, nb, sizeof nb, 8);

    const char *name = get_name(a);
    found[F_NAME] = name - (const char *)a;
    char long_name[256];
    memset(long_name, 'n', sizeof long_name - 1);
    long_name[sizeof long_name - 1] = 0;
    set_name(a, long_name); /* ggml keeps what its array holds, less the final 0 */
    found[F_MAX_NAME] = (int64_t)strlen(get_name(a)) + 1;
    found[F_EXTRA] = found[F_NAME] + found[F_MAX_NAME];
    void *extra;
    if (found[F_EXTRA] + (int64_t)sizeof extra <= (int64_t)tensor_bytes) {
        memcpy(&extra, (char *)a + found[F_EXTRA], sizeof extra);
        if (extra) found[F_EXTRA] = -1;
    }

    struct ggml_tensor *product = mul_mat(ctx, a, b);
    found[F_SRC] = find(product, tensor_bytes, 0, &a, sizeof a, 8);
    if (found[F_SRC] >= 0 && find(product, tensor_bytes, found[F_SRC] + 8, &b, sizeof b, 8) !=
                                 found[F_SRC] + 8)
        found[F_SRC] = -1;
    if (strcmp(op_desc(product), "MUL_MAT") == 0) {
        int64_t op = read_int(product, offsetof(struct ggml_tensor, op));
        if (op >= 0 && op < 1024 && strcmp(op_name((int)op), "MUL_MAT") == 0) {
            found[F_OP] = offsetof(struct ggml_tensor, op);
            found[F_OP_MUL_MAT] = op;
        }
    }

    /* A view: src[0] and view_src both point at the viewed tensor. */
    const size_t view_offset = 0x1f4;
    struct ggml_tensor *view = view_1d(ctx, a, 16, view_offset);
    int64_t first = find(view, tensor_bytes, 0, &a, sizeof a, 8);
    if (first >= 0) {
        found[F_VIEW_SRC] = find(view, tensor_bytes, first + 8, &a, sizeof a, 8);
        if (found[F_VIEW_SRC] >= 0 && found[F_SRC] >= 0)
            found[F_MAX_SRC] = (found[F_VIEW_SRC] - found[F_SRC]) / (int64_t)sizeof(void *);
        found[F_VIEW_OFFS] =
            find(view, tensor_bytes, found[F_VIEW_SRC] < 0 ? (int64_t)tensor_bytes
                                                           : found[F_VIEW_SRC] + 8,
                 &view_offset, sizeof view_offset, 8);
    }

    /* A custom operation keeps its function, task count and user data in op_params. */
    void *fun = (void *)never_run, *userdata = (void *)&found;
    struct ggml_tensor *args[1] = {b};
    struct ggml_tensor *custom =
        custom_4d(ctx, GGML_TYPE_I32, 1, 1, 1, 1, args, 1, fun, 3, userdata);
    /* op_params is an array of int32: its pointers sit 4-aligned (at 84 in 0.3.36). */
    int64_t params_at = find(custom, tensor_bytes, 0, &fun, sizeof fun, 4);
    found[F_OP_PARAMS] = params_at;
    if (params_at >= 0) {
        int tasks = 3;
        int64_t tasks_at = find(custom, tensor_bytes, params_at + 8, &tasks, sizeof tasks, 4);
        int64_t data_at = find(custom, tensor_bytes, params_at + 8, &userdata, sizeof userdata, 4);
        found[F_CUSTOM_TASKS] = tasks_at < 0 ? -1 : tasks_at - params_at;
        found[F_CUSTOM_DATA] = data_at < 0 ? -1 : data_at - params_at;
    }
    if (found[F_OP] >= 0 && strcmp(op_desc(custom), "CUSTOM") == 0) {
        int64_t op = read_int(custom, found[F_OP]);
        if (op >= 0 && op < 1024 && strcmp(op_name((int)op), "CUSTOM") == 0)
            found[F_OP_CUSTOM] = op;
    }
    int64_t type = read_int(custom, offsetof(struct ggml_tensor, type));
    if (type == GGML_TYPE_I32 && read_int(a, offsetof(struct ggml_tensor, type)) == GGML_TYPE_F32)
        found[F_TYPE] = offsetof(struct ggml_tensor, type);

    /* The type numbers ggml_abi.h names. */
    static const struct {
        int number;
        const char *name;
    } types[] = {{GGML_TYPE_F32, "f32"},   {GGML_TYPE_Q4_0, "q4_0"}, {GGML_TYPE_Q5_0, "q5_0"},
                 {GGML_TYPE_Q8_0, "q8_0"}, {GGML_TYPE_Q4_K, "q4_K"}, {GGML_TYPE_Q5_K, "q5_K"},
                 {GGML_TYPE_Q6_K, "q6_K"}, {GGML_TYPE_I32, "i32"}};
    found[F_TYPES] = 1;
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        const char *named = type_name(types[i].number);
        if (!named || strcmp(named, types[i].name) != 0) found[F_TYPES] = 0;
    }

    /* Memory from ggml's CPU buffer: the tensors' buffer and data. */
    void *buffer = alloc_tensors(ctx, cpu_buft());
    if (buffer) {
        void *data = get_data(a);
        found[F_BUFFER] = find(a, tensor_bytes, 0, &buffer, sizeof buffer, 8);
        found[F_DATA] = find(a, tensor_bytes, 0, &data, sizeof data, 8);
        found[F_BUFFER_IS_HOST] = buffer_is_host(buffer) ? 1 : 0;
        buffer_free(buffer);
    }
    ctx_free(ctx);
    return F_COUNT;
}

/* The same facts as ggml_abi.h declares them, for native_fence.py to compare. */
int64_t ls_abi_declared(int64_t *declared) {
    int64_t values[F_COUNT] = {
        [F_OBJECT_BYTES] = GGML_OBJECT_SIZE,
        [F_TENSOR_BYTES] = (int64_t)sizeof(struct ggml_tensor),
        [F_TYPE] = offsetof(struct ggml_tensor, type),
        [F_BUFFER] = offsetof(struct ggml_tensor, buffer),
        [F_NE] = offsetof(struct ggml_tensor, ne),
        [F_NB] = offsetof(struct ggml_tensor, nb),
        [F_OP] = offsetof(struct ggml_tensor, op),
        [F_OP_PARAMS] = offsetof(struct ggml_tensor, op_params),
        [F_SRC] = offsetof(struct ggml_tensor, src),
        [F_MAX_SRC] = sizeof(((struct ggml_tensor *)0)->src) / sizeof(void *),
        [F_VIEW_SRC] = offsetof(struct ggml_tensor, view_src),
        [F_VIEW_OFFS] = offsetof(struct ggml_tensor, view_offs),
        [F_DATA] = offsetof(struct ggml_tensor, data),
        [F_NAME] = offsetof(struct ggml_tensor, name),
        [F_MAX_NAME] = sizeof(((struct ggml_tensor *)0)->name),
        [F_EXTRA] = offsetof(struct ggml_tensor, extra),
        [F_OP_MUL_MAT] = GGML_OP_MUL_MAT,
        [F_OP_CUSTOM] = GGML_OP_CUSTOM,
        [F_CUSTOM_TASKS] = offsetof(struct custom_op_params, n_tasks),
        [F_CUSTOM_DATA] = offsetof(struct custom_op_params, userdata),
        [F_TYPES] = 1,
        [F_BUFFER_IS_HOST] = 1,
    };
    memcpy(declared, values, sizeof values);
    return F_COUNT;
}
