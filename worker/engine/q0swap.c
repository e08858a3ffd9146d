/* ggml's matmuls of Q8_0 and Q5_0 weights swapped for q0matmul.c's, and of Q4_K, Q5_K and
 * Q6_K weights for qkmatmul.c's (where ggml keeps its dot product for K-quants), which give the
 * same numbers to the bit, sooner, where the CPU has AVX-512 VNNI.
 *
 * The hook is graphdraw.c's sampler: llama.cpp builds every attached backend sampler into
 * each pass's graph, and the sampler hands the graph here, which turns each MUL_MAT that
 * q0matmul.c serves into a GGML_OP_CUSTOM running it on llama.cpp's threads. A pass built with
 * no sampler attached runs ggml's own; the numbers cannot tell the two apart, so batch
 * invariance holds either way.
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

static buffer_is_host_fn buffer_is_host;
static graph_n_nodes_fn graph_n_nodes;
static graph_node_fn graph_node;
static quantize_q8_fn quantize_q8;  /* ggml-cpu's quantize_row_q8_0 */
static quantize_q8_fn quantize_q8k; /* and quantize_row_q8_K */
static atomic_int kquant_swap_on;   /* ls_q0_swap_kquants: ggml keeps its dot product for them */
static int bound;                  /* ls_q0_bind found everything and the CPU can */
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

/* GGML_OP_CUSTOM in place of a MUL_MAT of Q8_0 or Q5_0 weights (q0matmul.c). */
static void q0_matmul(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)userdata;
    run_swapped(dst, ith, nth, quantize_q8, Q8_BLOCK, Q8_BLOCK_BYTES, ls_q0_matmul);
}

/* And of Q4_K, Q5_K or Q6_K weights, their activations in Q8_K blocks (qkmatmul.c). */
static void qk_matmul(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)userdata;
    run_swapped(dst, ith, nth, quantize_q8k, QK_K, ls_q8k_block_bytes(), ls_qk_matmul);
}

/* Swap a MUL_MAT for q0_matmul where it is one of Q8_0 or Q5_0 weights in host memory, as
 * loaded (not repacked: no extra), by floats in plain rows, two rows or more (one row is as
 * fast in ggml's own). A matmul whose weights are on a GPU is left to it. */
static int swap_matmul(struct ggml_tensor *t) {
    const struct ggml_tensor *w = t->src[0], *x = t->src[1];
    if (t->op != GGML_OP_MUL_MAT || !w || !x || !w->buffer || !buffer_is_host(w->buffer) ||
        w->extra)
        return 0;
    int64_t k = w->ne[0];
    size_t row_bytes;
    void (*kernel)(struct ggml_tensor *, int, int, void *);
    if ((w->type == GGML_TYPE_Q8_0 || w->type == GGML_TYPE_Q5_0) && k % Q8_BLOCK == 0) {
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
        x->ne[0] != k || x->nb[0] != sizeof(float) || x->ne[1] < 2 || x->ne[2] != 1 ||
        x->ne[3] != 1 || t->type != GGML_TYPE_F32 || t->nb[0] != sizeof(float) ||
        t->ne[1] != x->ne[1])
        return 0;
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

/* ggml's calls from the libraries at ggml_base and ggml_cpu (llama.cpp loaded them already):
 * the graph's, and ggml-cpu's quantizer for the activations; then the matmuls of Q8_0 and
 * Q5_0 weights are swapped (ls_q0_swap) where the CPU has AVX-512 VNNI. Returns whether they
 * will be: not where a call is missing or an operation's number is not the one declared. */
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
