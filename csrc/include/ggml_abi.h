/* What graphdraw.c and q0swap.c use of ggml's and llama.cpp's structs and enums, declared as
 * llama-cpp-python 0.3.36's llama.cpp has them (only the fields read or written are relied
 * on). ls_graph_bind checks ggml's tensor size against this declaration, and ls_q0_bind the
 * two operations' numbers by name; where they differ the worker samples on the host and
 * keeps ggml's matmuls. */
#ifndef LOOMSERVE_GGML_ABI_H
#define LOOMSERVE_GGML_ABI_H

#include <stddef.h>
#include <stdint.h>

#define GGML_TYPE_F32 0
#define GGML_TYPE_Q4_0 2
#define GGML_TYPE_Q5_0 6
#define GGML_TYPE_Q8_0 8
#define GGML_TYPE_Q4_K 12
#define GGML_TYPE_Q5_K 13
#define GGML_TYPE_Q6_K 14
#define GGML_TYPE_I32 26
#define GGML_OP_MUL_MAT 29
#define GGML_OP_CUSTOM 95
#define GGML_N_TASKS_MAX (-1)

struct ggml_tensor {
    int type;
    void *buffer;
    int64_t ne[4];
    size_t nb[4];
    int op;
    int32_t op_params[16];
    int32_t flags;
    struct ggml_tensor *src[10];
    struct ggml_tensor *view_src;
    size_t view_offs;
    void *data;
    char name[64];
    void *extra;
    char padding[8];
};

/* ggml's struct ggml_object, which ggml_tensor_overhead() counts with each tensor. */
#define GGML_OBJECT_SIZE 32

/* ggml's struct ggml_custom_op_params, which a GGML_OP_CUSTOM keeps in its op_params. */
struct custom_op_params {
    void (*fun)(struct ggml_tensor *, int, int, void *);
    int n_tasks;
    void *userdata;
};

#endif
