/* The decoder's whole forward for one sequence's one new token (batch-1 decode) on a CPU, in bf16.

   Why native: at batch 1 a CPU decode step is bound by reading the weights once. Through torch's eager ops the
   matrix-vector products ran at about 31 GB/s (oneDNN, prepacked) and the ~10 small ops of every layer cost
   about 1.9 ms a step on the 46M `bench` model, against a weights floor of about 2.3 ms
   (`benchmarks/engine_host.py`). Here every layer is one pass: each product streams its weight rows once
   (AVX-512 BF16 dot products, float32 sums), and norms, rotary, the K/V store and attention run between them
   on data that is still in cache, inside one OpenMP region (torch's own OpenMP runtime, so its threads are
   the ones torch uses, never a second pool beside them).

   Rounding follows `kernels/reference.py` (and so Hugging Face's Llama) op for op: every op's result is
   rounded to bf16 where the eager forward rounds it; what differs is only the order of float32 sums inside
   a product, a norm and attention, as between any two BLAS libraries. A row of a product is summed by one
   thread in a fixed order, so results do not depend on the thread count.

   Privacy: the only state is the caller's KV cache, written at the one validated slot; the scratch
   activations are zeroed before they are freed. Nothing is printed. Every index read from the step's inputs
   (position, slot, context length, block ids) is range-checked before anything is written or read. */

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef uint16_t bf16;

/* Per-layer weight pointers, in this order (NULL where the model has none). */
enum {
    W_INPUT_NORM, W_QKV, W_QKV_BIAS, W_Q_NORM, W_K_NORM, W_O, W_O_BIAS,
    W_POST_NORM, W_GATE_UP, W_GATE_UP_BIAS, W_DOWN, W_DOWN_BIAS, W_PER_LAYER
};

/* Return codes: `kernels/cpu_decode.py` turns each into a KernelInputError naming the input. */
enum {
    OK, BAD_QUERY_OFFSETS, BAD_POSITION, BAD_SLOT, BAD_CONTEXT, BAD_BLOCK_ID, NO_MEMORY
};

typedef struct {
    int64_t hidden, intermediate, layers, heads, kv_heads, head_dim;
    int64_t num_blocks, block_size, table_width, max_positions, threads;
    double eps, scale;
} veil_dims;

typedef struct {
    const int64_t *position;   /* [1] */
    const int64_t *slot;       /* [1] */
    const int32_t *context;    /* [1]: tokens in the cache including the new one */
    const int32_t *query_offsets; /* [2]: must be 0, 1 */
    const int32_t *block_table;   /* [table_width] */
} veil_step;

static inline float from_bf16(bf16 value) {
    uint32_t bits = (uint32_t)value << 16;
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* Round to nearest even, NaN to the quiet NaN: c10::BFloat16's conversion, bit for bit. */
static inline bf16 to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (bf16)(bits >> 16);
}

static inline float round_bf16(float value) { return from_bf16(to_bf16(value)); }

static inline __m512bh load_bh(const bf16 *from, int64_t count) {
    if (count >= 32) return (__m512bh)_mm512_loadu_si512(from);
    return (__m512bh)_mm512_maskz_loadu_epi16((__mmask32)((1ull << count) - 1), from);
}

static inline __m512 widen16(const bf16 *from) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const void *)from)), 16));
}

static float dot(const bf16 *a, const bf16 *b, int64_t n) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; k += 32) sum = _mm512_dpbf16_ps(sum, load_bh(a + k, n - k), load_bh(b + k, n - k));
    return _mm512_reduce_add_ps(sum);
}

static inline bf16 with_bias(float sum, const bf16 *bias, int64_t row) {
    return to_bf16(bias ? sum + from_bf16(bias[row]) : sum);
}

/* out[rows] = bf16(weight[rows, in] . x + bias): BLOCK rows at a time share each load of x and keep as many
   weight streams in flight (8 streamed fastest on the bench model's shapes, against 4 and 16:
   `benchmarks/engine_host.py`); blocks are dealt to the team's threads in fixed chunks (an orphaned
   `omp for`: called inside the forward's parallel region), the rows past the last block one by one. */
#define BLOCK 8
static void product(const bf16 *weight, const bf16 *bias, const bf16 *x, bf16 *out, int64_t rows, int64_t in) {
    const int64_t blocks = rows / BLOCK, whole = in / 32 * 32;
    const __mmask32 tail = (__mmask32)((1ull << (in - whole)) - 1);
#pragma omp for schedule(static) nowait
    for (int64_t block = 0; block < blocks; ++block) {
        const bf16 *w = weight + block * BLOCK * in;
        __m512 sums[BLOCK];
        for (int r = 0; r < BLOCK; ++r) sums[r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < whole; k += 32) {
            const __m512bh xs = (__m512bh)_mm512_loadu_si512(x + k);
            for (int r = 0; r < BLOCK; ++r)
                sums[r] = _mm512_dpbf16_ps(sums[r], (__m512bh)_mm512_loadu_si512(w + r * in + k), xs);
        }
        if (tail) {
            const __m512bh xs = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + whole);
            for (int r = 0; r < BLOCK; ++r)
                sums[r] = _mm512_dpbf16_ps(sums[r], (__m512bh)_mm512_maskz_loadu_epi16(tail, w + r * in + whole), xs);
        }
        for (int r = 0; r < BLOCK; ++r)
            out[block * BLOCK + r] = with_bias(_mm512_reduce_add_ps(sums[r]), bias, block * BLOCK + r);
    }
#pragma omp for schedule(static)
    for (int64_t row = blocks * BLOCK; row < rows; ++row)
        out[row] = with_bias(dot(weight + row * in, x, in), bias, row);
}

/* out = bf16(weight * bf16(x * rsqrt(mean(x^2) + eps))): torch.rms_norm, then the weight, as reference.rms_norm. */
static void rms_norm(const bf16 *x, const bf16 *weight, bf16 *out, int64_t n, float eps) {
    __m512 squares = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = widen16(x + i);
        squares = _mm512_fmadd_ps(v, v, squares);
    }
    float sum = _mm512_reduce_add_ps(squares);
    for (; i < n; ++i) sum += from_bf16(x[i]) * from_bf16(x[i]);
    const float inverse = 1.0f / sqrtf(sum / (float)n + eps);
    for (i = 0; i < n; ++i) out[i] = to_bf16(from_bf16(weight[i]) * round_bf16(from_bf16(x[i]) * inverse));
}

/* residual = bf16(residual + x): the decoder's residual add, rounded as torch adds two bf16 tensors. */
static void add_into(bf16 *residual, const bf16 *x, int64_t n) {
    for (int64_t i = 0; i < n; ++i) residual[i] = to_bf16(from_bf16(residual[i]) + from_bf16(x[i]));
}

/* Rotate-half rotary embedding of one head, rounded as reference._rotate: x*cos + rotate_half(x)*sin. */
static void rotate(bf16 *x, const bf16 *cos, const bf16 *sin, int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        const float x1 = from_bf16(x[i]), x2 = from_bf16(x[i + half]);
        const float c = from_bf16(cos[i]), s = from_bf16(sin[i]);
        x[i] = to_bf16(round_bf16(x1 * c) + round_bf16(-x2 * s));
        x[i + half] = to_bf16(round_bf16(x2 * c) + round_bf16(x1 * s));
    }
}

/* A cached token's K or V rows are read head by head, a slot's stride apart, from blocks anywhere in the
   cache (last written a step ago, since evicted by the weights streaming through): fetched AHEAD tokens
   early, they arrive by the time they are read instead of each read waiting on memory. */
#define AHEAD 4

static inline int64_t slot_at(const veil_dims *d, const int32_t *table, int64_t t) {
    return (table[t / d->block_size] * d->block_size + t % d->block_size) * d->kv_heads * d->head_dim;
}

static inline void fetch_row(const bf16 *row, int64_t dim) {
    for (int64_t i = 0; i < dim; i += 32) _mm_prefetch((const char *)(row + i), _MM_HINT_T0);
}

/* Attention of the query heads of KV heads [first, last) over the sequence's pages, as SDPA's CPU kernel
   computes it in bf16: scores in float32, softmax weights rounded to bf16 before they weight V, the sum of the
   unrounded weights dividing at the end. One pass over the tokens reads each token's K (then V) rows of these
   heads together, contiguous in its slot. `sums`: (last - first) * group * head_dim floats. */
static void attend(const veil_dims *d, const bf16 *queries, const bf16 *k_layer, const bf16 *v_layer,
                   const int32_t *table, int64_t context, int64_t first, int64_t last, float *scores, float *sums,
                   bf16 *out) {
    const int64_t dim = d->head_dim, group = d->heads / d->kv_heads, heads = (last - first) * group;
    const int64_t width = (last - first) * dim;  /* the rows read of each token's slot */
    const bf16 *q = queries + first * group * dim;
    for (int64_t t = 0; t < context; ++t) {
        const bf16 *k = k_layer + slot_at(d, table, t) + first * dim;
        if (t + AHEAD < context) fetch_row(k_layer + slot_at(d, table, t + AHEAD) + first * dim, width);
        for (int64_t h = 0; h < heads; ++h)
            scores[h * context + t] = dot(q + h * dim, k + h / group * dim, dim) * (float)d->scale;
    }
    float totals[heads];
    for (int64_t h = 0; h < heads; ++h) {
        float *row = scores + h * context, largest = -INFINITY, total = 0.0f;
        for (int64_t t = 0; t < context; ++t) largest = row[t] > largest ? row[t] : largest;
        for (int64_t t = 0; t < context; ++t) {
            const float weight = expf(row[t] - largest);
            total += weight;
            row[t] = round_bf16(weight);
        }
        totals[h] = total;
    }
    for (int64_t i = 0; i < heads * dim; ++i) sums[i] = 0.0f;
    for (int64_t t = 0; t < context; ++t) {
        const bf16 *v = v_layer + slot_at(d, table, t) + first * dim;
        if (t + AHEAD < context) fetch_row(v_layer + slot_at(d, table, t + AHEAD) + first * dim, width);
        for (int64_t h = 0; h < heads; ++h) {
            const float weight = scores[h * context + t];
            const bf16 *row = v + h / group * dim;
            float *sum = sums + h * dim;
            for (int64_t j = 0; j < dim; ++j) sum[j] += weight * from_bf16(row[j]);
        }
    }
    for (int64_t h = 0; h < heads; ++h) {
        const float inverse = 1.0f / totals[h];
        for (int64_t j = 0; j < dim; ++j) out[(first * group + h) * dim + j] = to_bf16(sums[h * dim + j] * inverse);
    }
}

/* The KV heads [first, last) this thread attends with (with their query heads): contiguous ranges, so each
   thread reads its part of every cached slot in one pass. */
static void my_heads(const veil_dims *d, int64_t *first, int64_t *last) {
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
    *first = d->kv_heads * me / team;
    *last = d->kv_heads * (me + 1) / team;
}

typedef struct {
    bf16 *residual, *normed, *qkv, *attended, *gate_up, *act, *hidden;
    float *scores, *sums;
    int64_t row;  /* elements between two threads' residual (and normed) rows */
    size_t bytes;
    void *base;
} scratch;

static int64_t padded(int64_t elements) { return (elements + 31) / 32 * 32; }

/* Every thread keeps its own residual stream and its norm: each computes them alike, which costs less than
   one thread computing them while the others wait at a barrier. */
static int scratch_alloc(scratch *s, const veil_dims *d, int64_t context) {
    const int64_t q_width = d->heads * d->head_dim, kv_width = d->kv_heads * d->head_dim;
    s->row = padded(d->hidden);
    const int64_t sizes[] = {d->threads * s->row, d->threads * s->row, padded(q_width + 2 * kv_width),
                             padded(q_width), padded(2 * d->intermediate), padded(d->intermediate), s->row};
    size_t elements = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; ++i) elements += (size_t)sizes[i];
    s->bytes = elements * sizeof(bf16) + sizeof(float) * (size_t)(d->heads * (context + d->head_dim));
    s->base = calloc(1, s->bytes);
    if (!s->base) return NO_MEMORY;
    bf16 *next = s->base;
    bf16 **parts[] = {&s->residual, &s->normed, &s->qkv, &s->attended, &s->gate_up, &s->act, &s->hidden};
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; ++i) {
        *parts[i] = next;
        next += sizes[i];
    }
    s->scores = (float *)next;
    s->sums = s->scores + d->heads * context;
    return OK;
}

static void scratch_free(scratch *s) {
    /* Activations of this request: zeroed before the allocator can hand the memory to anyone else
       (explicit_bzero: a memset the compiler may not drop as a store to memory about to be freed). */
    explicit_bzero(s->base, s->bytes);
    free(s->base);
}

static int check_step(const veil_dims *d, const veil_step *s) {
    if (s->query_offsets[0] != 0 || s->query_offsets[1] != 1) return BAD_QUERY_OFFSETS;
    const int64_t position = *s->position, slot = *s->slot, context = *s->context;
    if (position < 0 || position >= d->max_positions) return BAD_POSITION;
    if (slot < 0 || slot >= d->num_blocks * d->block_size) return BAD_SLOT;
    if (context < 1 || context > d->table_width * d->block_size) return BAD_CONTEXT;
    for (int64_t b = 0; b < (context + d->block_size - 1) / d->block_size; ++b)
        if (s->block_table[b] < 0 || s->block_table[b] >= d->num_blocks) return BAD_BLOCK_ID;
    return OK;
}

/* This thread's share of what lies between the qkv product and attention: its heads' optional norms and
   rotary, and its KV heads' K and V stored at the new token's slot (read back only by this thread's attention). */
static void place_keys(const veil_dims *d, const bf16 *const *w, const veil_step *s, const bf16 *cos_cache,
                       const bf16 *sin_cache, bf16 *qkv, bf16 *k_layer, bf16 *v_layer, int64_t first, int64_t last) {
    const int64_t dim = d->head_dim, half = dim / 2, group = d->heads / d->kv_heads;
    const bf16 *cos = cos_cache + *s->position * half, *sin = sin_cache + *s->position * half;
    bf16 *keys = qkv + d->heads * dim, *values = keys + d->kv_heads * dim;
    for (int64_t h = first * group; h < last * group; ++h) {
        if (w[W_Q_NORM]) rms_norm(qkv + h * dim, w[W_Q_NORM], qkv + h * dim, dim, (float)d->eps);
        rotate(qkv + h * dim, cos, sin, half);
    }
    for (int64_t h = first; h < last; ++h) {
        if (w[W_K_NORM]) rms_norm(keys + h * dim, w[W_K_NORM], keys + h * dim, dim, (float)d->eps);
        rotate(keys + h * dim, cos, sin, half);
    }
    const int64_t slot = *s->slot * d->kv_heads * dim + first * dim, width = (last - first) * dim;
    memcpy(k_layer + slot, keys + first * dim, sizeof(bf16) * (size_t)width);
    memcpy(v_layer + slot, values + first * dim, sizeof(bf16) * (size_t)width);
}

static void silu_and_mul(const bf16 *gate_up, bf16 *out, int64_t width) {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < width; ++i) {
        const float gate = from_bf16(gate_up[i]);
        out[i] = to_bf16(round_bf16(gate / (1.0f + expf(-gate))) * from_bf16(gate_up[width + i]));
    }
}

static void layer(const veil_dims *d, const bf16 *const *w, const veil_step *s, const bf16 *cos_cache,
                  const bf16 *sin_cache, bf16 *k_layer, bf16 *v_layer, scratch *m, int first_layer) {
    const int64_t context = *s->context, q_width = d->heads * d->head_dim, group = d->heads / d->kv_heads;
    bf16 *residual = m->residual + omp_get_thread_num() * m->row, *normed = m->normed + omp_get_thread_num() * m->row;
    int64_t first, last;
    my_heads(d, &first, &last);
    if (first_layer) memcpy(residual, m->hidden, sizeof(bf16) * (size_t)d->hidden);
    else add_into(residual, m->hidden, d->hidden);
    rms_norm(residual, w[W_INPUT_NORM], normed, d->hidden, (float)d->eps);
    product(w[W_QKV], w[W_QKV_BIAS], normed, m->qkv, q_width + 2 * d->kv_heads * d->head_dim, d->hidden);
    if (first < last) {
        place_keys(d, w, s, cos_cache, sin_cache, m->qkv, k_layer, v_layer, first, last);
        attend(d, m->qkv, k_layer, v_layer, s->block_table, context, first, last, m->scores + first * group * context,
               m->sums + first * group * d->head_dim, m->attended);
    }
#pragma omp barrier
    product(w[W_O], w[W_O_BIAS], m->attended, m->hidden, d->hidden, q_width);
    add_into(residual, m->hidden, d->hidden);
    rms_norm(residual, w[W_POST_NORM], normed, d->hidden, (float)d->eps);
    product(w[W_GATE_UP], w[W_GATE_UP_BIAS], normed, m->gate_up, 2 * d->intermediate, d->hidden);
    silu_and_mul(m->gate_up, m->act, d->intermediate);
    product(w[W_DOWN], w[W_DOWN_BIAS], m->act, m->hidden, d->hidden, d->intermediate);
}

/* The forward: `embedded` [hidden] is the token's embedding row; `out` [hidden] receives the final norm of
   the residual stream (what `LlamaFamilyForCausalLM.forward` returns). The layer's K/V go into `kv`
   [2 * layers, num_blocks, block_size, kv_heads, head_dim] at the step's slot. */
int veil_decode_one(const veil_dims *d, const bf16 *const *weights, const bf16 *final_norm, bf16 *kv,
                    const bf16 *cos_cache, const bf16 *sin_cache, const veil_step *s, const bf16 *embedded,
                    bf16 *out) {
    const int status = check_step(d, s);
    if (status != OK) return status;
    scratch m;
    if (scratch_alloc(&m, d, *s->context) != OK) return NO_MEMORY;
    memcpy(m.hidden, embedded, sizeof(bf16) * (size_t)d->hidden);
    const int64_t cache_elements = d->num_blocks * d->block_size * d->kv_heads * d->head_dim;
#pragma omp parallel num_threads((int)d->threads)
    {
        for (int64_t l = 0; l < d->layers; ++l)
            layer(d, weights + l * W_PER_LAYER, s, cos_cache, sin_cache, kv + 2 * l * cache_elements,
                  kv + (2 * l + 1) * cache_elements, &m, l == 0);
    }
    add_into(m.residual, m.hidden, d->hidden);
    rms_norm(m.residual, final_norm, out, d->hidden, (float)d->eps);
    scratch_free(&m);
    return OK;
}

/* out[rows] = bf16(weight[rows, in] . x + bias) for one input row: the output head of a batch-1 decode. */
void veil_product(const bf16 *weight, const bf16 *bias, const bf16 *x, bf16 *out, int64_t rows, int64_t in,
                  int64_t threads) {
#pragma omp parallel num_threads((int)threads)
    product(weight, bias, x, out, rows, in);
}
