/* ggml's matmuls of Q8_0, Q5_0 and Q4_0 weights swapped for q0matmul.c's, and of Q4_K, Q5_K and
 * Q6_K weights for qkmatmul.c's (where ggml keeps its dot product for K-quants), which give the
 * same numbers to the bit, sooner: with AVX-512 VNNI, and with AVX2 a Q8_0 matmul of 1-8 rows.
 *
 * The hook is graphdraw.c's sampler: llama.cpp builds every attached backend sampler into
 * each pass's graph, and the sampler hands the graph here, which turns each MUL_MAT that
 * q0matmul.c serves into a GGML_OP_CUSTOM running it on llama.cpp's threads. A pass built with
 * no sampler attached runs ggml's own; the numbers cannot tell the two apart, so batch
 * invariance holds either way. That rests on the kernels repeating the arithmetic of the ggml
 * that is loaded, so ls_q0_bind checks each type against ggml's own dot product first and
 * leaves any type that differs (another llama.cpp, another build) to ggml.
 */

#include <dlfcn.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_abi.h"

#define Q8_BLOCK 32
#define Q8_BLOCK_BYTES 34 /* ggml's block_q8_0: an fp16 scale and 32 quants */
#define QK_K 256          /* a K-quant superblock's weights */

/* q0matmul.c's */
int ls_q0_matmul_supported(void);
int ls_q0_sooner(int type, int64_t m);
int64_t ls_q0_row_bytes(int type, int64_t nb);
int ls_q0_matmul(const void *weights, int type, int64_t nb, int64_t first_row, int64_t end_row,
                 const void *acts, int64_t m, float *out, int64_t ldo);
void *ls_q0_thread_buffer(int slot, size_t bytes);
/* qkmatmul.c's */
int64_t ls_qk_row_bytes(int type, int64_t nb);
int64_t ls_q8k_block_bytes(void);
int ls_qk_matmul(const void *weights, int type, int64_t nb, int64_t first_row, int64_t end_row,
                 const void *acts, int64_t m, float *out, int64_t ldo);

typedef const char *(*op_name_fn)(int);
typedef bool (*buffer_is_host_fn)(void *);
typedef int (*graph_n_nodes_fn)(void *);
typedef struct ggml_tensor *(*graph_node_fn)(void *, int);
typedef void (*quantize_q8_fn)(const float *, void *, int64_t);
typedef void (*vec_dot_fn)(int n, float *out, size_t, const void *weights, size_t,
                           const void *acts, size_t, int rows);
typedef void (*init_fn)(void);

static buffer_is_host_fn buffer_is_host;
static graph_n_nodes_fn graph_n_nodes;
static graph_node_fn graph_node;
static quantize_q8_fn quantize_q8;  /* ggml-cpu's quantize_row_q8_0 */
static quantize_q8_fn quantize_q8k; /* and quantize_row_q8_K */
static atomic_int kquant_swap_on;   /* ls_q0_swap_kquants: ggml keeps its dot product for them */
static int bound;                  /* ls_q0_bind found everything and the CPU can */
static uint32_t swappable;         /* 1 << type for each type whose check agreed */
static atomic_int q0_swap_on;      /* ls_q0_swap: swap the matmuls where it can */
static atomic_long q0_swapped;     /* matmuls swapped, for tests and benchmarks */

typedef int (*kernel_fn)(const void *weights, int type, int64_t nb, int64_t first_row,
                         int64_t end_row, const void *acts, int64_t m, float *out, int64_t ldo);

/* This thread's share of a swapped matmul: it quantizes the pass's activations as ggml does
 * for the weights' type (blocks of `block` floats, `block_bytes` bytes each), then runs the
 * kernel on its share of the weight rows, cut in pairs. */
static void run_swapped(struct ggml_tensor *dst, int ith, int nth, quantize_q8_fn quantize,
                        int64_t block, int64_t block_bytes, kernel_fn kernel) {
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1];
    int64_t k = w->ne[0], n = w->ne[1], m = x->ne[1], nb = k / block;
    int64_t pairs = (n + 1) / 2;
    int64_t first = 2 * (pairs * ith / nth), end = 2 * (pairs * (ith + 1) / nth);
    if (end > n) end = n;
    if (first >= end) return;
    char *acts = ls_q0_thread_buffer(0, (size_t)(m * nb * block_bytes));
    if (!acts) abort(); /* out of memory: as ggml's own allocations end */
    for (int64_t j = 0; j < m; j++)
        quantize((const float *)((const char *)x->data + j * x->nb[1]), acts + j * nb * block_bytes,
                 k);
    if (!kernel(w->data, w->type, nb, first, end, acts, m, dst->data,
                (int64_t)(dst->nb[1] / sizeof(float))))
        abort();
}

/* GGML_OP_CUSTOM in place of a MUL_MAT of Q8_0, Q5_0 or Q4_0 weights (q0matmul.c). */
static void q0_matmul(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)userdata;
    run_swapped(dst, ith, nth, quantize_q8, Q8_BLOCK, Q8_BLOCK_BYTES, ls_q0_matmul);
}

/* And of Q4_K, Q5_K or Q6_K weights, their activations in Q8_K blocks (qkmatmul.c). */
static void qk_matmul(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)userdata;
    run_swapped(dst, ith, nth, quantize_q8k, QK_K, ls_q8k_block_bytes(), ls_qk_matmul);
}

/* Swap a MUL_MAT for q0_matmul where it is one of Q8_0, Q5_0 or Q4_0 weights in host memory,
 * as loaded (not repacked: no extra), by floats in plain rows, as many as ls_q0_sooner says
 * are sooner on this CPU; and for qk_matmul (AVX-512 VNNI) by two rows or more (one row is
 * as fast in ggml's own). A matmul whose weights are on a GPU is left to it. */
static int swap_matmul(struct ggml_tensor *t) {
    const struct ggml_tensor *w = t->src[0], *x = t->src[1];
    if (t->op != GGML_OP_MUL_MAT || !w || !x || !w->buffer || !buffer_is_host(w->buffer) ||
        w->extra)
        return 0;
    int64_t k = w->ne[0];
    size_t row_bytes;
    void (*kernel)(struct ggml_tensor *, int, int, void *);
    if (w->type < 0 || w->type > 31 || !(swappable & (1u << w->type))) return 0;
    if ((w->type == GGML_TYPE_Q8_0 || w->type == GGML_TYPE_Q5_0 || w->type == GGML_TYPE_Q4_0) &&
        k % Q8_BLOCK == 0) {
        row_bytes = (size_t)ls_q0_row_bytes(w->type, k / Q8_BLOCK);
        kernel = q0_matmul;
    } else if ((w->type == GGML_TYPE_Q4_K || w->type == GGML_TYPE_Q5_K ||
                w->type == GGML_TYPE_Q6_K) &&
               k % QK_K == 0 && atomic_load(&kquant_swap_on)) {
        row_bytes = (size_t)ls_qk_row_bytes(w->type, k / QK_K);
        kernel = qk_matmul;
    } else {
        return 0;
    }
    if (w->nb[1] != row_bytes || w->ne[2] != 1 || w->ne[3] != 1 || x->type != GGML_TYPE_F32 ||
        x->ne[0] != k || x->nb[0] != sizeof(float) || x->ne[2] != 1 ||
        x->ne[3] != 1 || t->type != GGML_TYPE_F32 || t->nb[0] != sizeof(float) ||
        t->ne[1] != x->ne[1])
        return 0;
    if (kernel == q0_matmul ? !ls_q0_sooner(w->type, x->ne[1]) : x->ne[1] < 2) return 0;
    struct custom_op_params params = {kernel, GGML_N_TASKS_MAX, NULL};
    memcpy(t->op_params, &params, sizeof params);
    t->op = GGML_OP_CUSTOM;
    return 1;
}

/* Every matmul of a graph that q0matmul.c serves, swapped once: graphdraw.c's samplers call
 * this as llama.cpp builds each pass's graph with them (every attached sampler, so the first
 * swaps and the others find none left). */
void ls_q0_swap_graph(void *graph) {
    if (!atomic_load(&q0_swap_on)) return;
    int n = graph_n_nodes(graph);
    for (int i = 0; i < n; i++)
        if (swap_matmul(graph_node(graph, i))) atomic_fetch_add(&q0_swapped, 1);
}

#define CHECK_K 768   /* weights a row in the check: 24 blocks of 32, 3 superblocks */
#define CHECK_ROWS 5  /* weight rows: two pairs and one alone */
#define CHECK_M 3     /* activation rows */

static uint32_t next_random(uint32_t *state) {
    *state = *state * 1664525u + 1013904223u;
    return *state >> 8;
}

/* Whether the kernel for weights of `type` gives the numbers of `vec_dot` (ggml's dot product
 * for them): five rows of pseudo-random weights (their fp16 factors finite, of either sign)
 * against three rows of activations that ggml's quantizer wrote, output for output. */
static int agrees(int type, vec_dot_fn vec_dot) {
    int kquant = type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K || type == GGML_TYPE_Q6_K;
    quantize_q8_fn quantize = kquant ? quantize_q8k : quantize_q8;
    kernel_fn kernel = kquant ? ls_qk_matmul : ls_q0_matmul;
    int64_t block = kquant ? QK_K : Q8_BLOCK, nb = CHECK_K / block;
    int64_t row_bytes = kquant ? ls_qk_row_bytes(type, nb) : ls_q0_row_bytes(type, nb);
    int64_t act_row_bytes = nb * (kquant ? ls_q8k_block_bytes() : Q8_BLOCK_BYTES);
    if (!quantize || !vec_dot || row_bytes <= 0) return 0;
    /* Where each block keeps its fp16 factors: d (and dmin) first, Q6_K's d last. */
    int64_t block_bytes = row_bytes / nb, halves[2] = {0, 2};
    int n_halves = type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K ? 2 : 1;
    if (type == GGML_TYPE_Q6_K) halves[0] = block_bytes - 2;
    unsigned char *w = malloc((size_t)(CHECK_ROWS * row_bytes));
    unsigned char *acts = malloc((size_t)(CHECK_M * act_row_bytes));
    float x[CHECK_K], ours[CHECK_M * CHECK_ROWS];
    int same = w && acts;
    uint32_t state = 12345u + (uint32_t)type;
    for (int64_t i = 0; same && i < CHECK_ROWS * row_bytes; i++)
        w[i] = (unsigned char)next_random(&state);
    for (int64_t b = 0; same && b < CHECK_ROWS * nb; b++)
        for (int h = 0; h < n_halves; h++) {
            uint32_t r = next_random(&state);
            uint16_t half = (uint16_t)(0x1000 + (r & 0x7ff) + ((r >> 11) & 1) * 0x8000);
            memcpy(w + b * block_bytes + halves[h], &half, sizeof half);
        }
    for (int j = 0; same && j < CHECK_M; j++) {
        for (int i = 0; i < CHECK_K; i++)
            x[i] = (float)((int)(next_random(&state) % 2001) - 1000) / 250.0f;
        quantize(x, acts + j * act_row_bytes, CHECK_K);
    }
    same = same && kernel(w, type, nb, 0, CHECK_ROWS, acts, CHECK_M, ours, CHECK_ROWS);
    for (int j = 0; same && j < CHECK_M; j++)
        for (int r = 0; same && r < CHECK_ROWS; r++) {
            float ref;
            vec_dot(CHECK_K, &ref, 0, w + r * row_bytes, 0, acts + j * act_row_bytes, 0, 1);
            same = memcmp(&ref, &ours[j * CHECK_ROWS + r], sizeof ref) == 0;
        }
    free(w);
    free(acts);
    return same;
}

/* ls_q0_bind's check of one type, with `vec_dot` as ggml's dot product for it (for tests). */
int ls_q0_check(int type, void *vec_dot) {
    return agrees(type, (vec_dot_fn)vec_dot);
}

/* Whether matmuls of weights of `type` are swapped (bound, and its check agreed). */
int ls_q0_swappable(int type) {
    return type >= 0 && type <= 31 && (swappable >> type & 1u);
}

/* ggml's calls from the libraries at ggml_base and ggml_cpu (llama.cpp loaded them already):
 * the graph's, and ggml-cpu's quantizer for the activations; then the matmuls that are sooner
 * in q0matmul.c's and qkmatmul.c's kernels are swapped (ls_q0_swap) where the CPU runs them.
 * Returns whether they will be: not where a call is missing or an operation's number is not
 * the one declared. */
int ls_q0_bind(const char *ggml_base, const char *ggml_cpu) {
    void *base = dlopen(ggml_base, RTLD_NOW), *cpu = dlopen(ggml_cpu, RTLD_NOW);
    if (!base || !cpu) return 0;
    op_name_fn op_name = (op_name_fn)dlsym(base, "ggml_op_name");
    buffer_is_host = (buffer_is_host_fn)dlsym(base, "ggml_backend_buffer_is_host");
    graph_n_nodes = (graph_n_nodes_fn)dlsym(base, "ggml_graph_n_nodes");
    graph_node = (graph_node_fn)dlsym(base, "ggml_graph_node");
    quantize_q8 = (quantize_q8_fn)dlsym(cpu, "quantize_row_q8_0");
    quantize_q8k = (quantize_q8_fn)dlsym(cpu, "quantize_row_q8_K");
    int can = op_name && strcmp(op_name(GGML_OP_MUL_MAT), "MUL_MAT") == 0 &&
              strcmp(op_name(GGML_OP_CUSTOM), "CUSTOM") == 0 && buffer_is_host &&
              graph_n_nodes && graph_node && quantize_q8 && ls_q0_matmul_supported();
    /* Each type's kernel against ggml's own dot product (its fp16 tables set up first). */
    static const struct {
        int type;
        const char *vec_dot;
    } types[] = {{GGML_TYPE_Q8_0, "ggml_vec_dot_q8_0_q8_0"},
                 {GGML_TYPE_Q4_0, "ggml_vec_dot_q4_0_q8_0"},
                 {GGML_TYPE_Q5_0, "ggml_vec_dot_q5_0_q8_0"},
                 {GGML_TYPE_Q4_K, "ggml_vec_dot_q4_K_q8_K"},
                 {GGML_TYPE_Q5_K, "ggml_vec_dot_q5_K_q8_K"},
                 {GGML_TYPE_Q6_K, "ggml_vec_dot_q6_K_q8_K"}};
    init_fn cpu_init = (init_fn)dlsym(cpu, "ggml_cpu_init");
    if (can && cpu_init) cpu_init();
    swappable = 0;
    for (size_t i = 0; can && cpu_init && i < sizeof types / sizeof types[0]; i++)
        if (agrees(types[i].type, (vec_dot_fn)dlsym(cpu, types[i].vec_dot)))
            swappable |= 1u << types[i].type;
    bound = can;
    atomic_store(&q0_swap_on, can);
    return can;
}

/* Whether graphs built from now on swap their matmuls (on after ls_q0_bind where it can; off
 * for benchmarks and tests of ggml's own). */
void ls_q0_swap(int on) {
    atomic_store(&q0_swap_on, on && bound);
}

/* Whether graphs built from now on swap Q4_K, Q5_K and Q6_K matmuls too: only where ggml would run
 * its dot product for them at every row count (the worker's `--cpu-matmul dot`), whose
 * arithmetic qkmatmul.c repeats; ggml's tiled matmul sums in another order. */
void ls_q0_swap_kquants(int on) {
    atomic_store(&kquant_swap_on, on && quantize_q8k != NULL);
}

/* How many matmuls were swapped so far. */
int64_t ls_q0_swapped(void) {
    return (int64_t)atomic_load(&q0_swapped);
}
