/* The decoder's whole forward for one sequence's one new token (batch-1 decode) on a CPU, in bf16; and the
   paged attention of any step's new tokens, bf16 or float32 (`veil_paged_attention`, at the end).

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
   activations and attention scores are zeroed before they are freed. Nothing is printed. Every index read from the step's inputs
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
    int64_t num_blocks, block_size, table_width, max_positions, threads, vocab;
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
   `omp for`: called inside the forward's parallel region), the rows past the last block one by one.
   Each block first asks for the next block's lines (a prefetch never faults, past the end included): with
   the hardware prefetcher alone a batch-1 step took 5% longer on 1 thread and 5 to 8% on 2 (two builds
   alternated in one engine's steps); the next block's lines asked for in step with the loads, or two
   blocks ahead, or into L2 only, gained nothing. */
#define BLOCK 8
static inline __attribute__((always_inline)) void store(bf16 *out, float *wide, int64_t row, bf16 value) {
    if (wide) wide[row] = from_bf16(value);
    else out[row] = value;
}

/* `product` into `out` (bf16) or, where `wide` is given, into `wide` as float32: the same bf16 values widened
   (the eager output head's `linear(...).float()`). */
static inline __attribute__((always_inline)) void product_into(const bf16 *weight, const bf16 *bias, const bf16 *x,
                                                               bf16 *out, float *wide, int64_t rows, int64_t in) {
    const int64_t blocks = rows / BLOCK, whole = in / 32 * 32;
    const __mmask32 tail = (__mmask32)((1ull << (in - whole)) - 1);
#pragma omp for schedule(static) nowait
    for (int64_t block = 0; block < blocks; ++block) {
        const bf16 *w = weight + block * BLOCK * in;
        __m512 sums[BLOCK];
        for (int r = 0; r < BLOCK; ++r) sums[r] = _mm512_setzero_ps();
        const uintptr_t next = (uintptr_t)w + BLOCK * in * sizeof(bf16);  /* an address, not a C pointer */
        for (uintptr_t line = 0; line < BLOCK * in * sizeof(bf16); line += 64)
            _mm_prefetch((const char *)(next + line), _MM_HINT_T0);
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
            store(out, wide, block * BLOCK + r, with_bias(_mm512_reduce_add_ps(sums[r]), bias, block * BLOCK + r));
    }
#pragma omp for schedule(static)
    for (int64_t row = blocks * BLOCK; row < rows; ++row)
        store(out, wide, row, with_bias(dot(weight + row * in, x, in), bias, row));
}

static void product(const bf16 *weight, const bf16 *bias, const bf16 *x, bf16 *out, int64_t rows, int64_t in) {
    product_into(weight, bias, x, out, NULL, rows, in);
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

/* ---- Attention over the paged KV cache, for tokens that each attend to their whole context ----
   Shared by the forward above and `veil_decode_attention` (a step of decode tokens, one per sequence), in bf16
   or float32: K, V, queries and output are all one of the two (`attention_shape.bf16`). */

typedef struct {
    int64_t heads, kv_heads, head_dim, block_size;
    float scale;
    int bf16;  /* 1: bf16 K/V/queries/output, the softmax weights rounded to bf16 as SDPA's bf16 kernel does */
} attention_shape;

static inline __mmask16 lanes(int64_t count) {
    return count >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1);
}

/* Elements [at, at + min(16, count)) of a bf16 or float32 row, as float32 lanes (zero past the count). */
static inline __m512 load_lanes(const void *row, int64_t at, int64_t count, int is_bf16) {
    if (is_bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(lanes(count), (const bf16 *)row + at)), 16));
    return _mm512_maskz_loadu_ps(lanes(count), (const float *)row + at);
}

/* e^x for 16 lanes of x <= 0 (a score less the row's largest), within about 1 ulp of expf: 2^n * e^r with
   r = x - n ln2 in [-ln2/2, ln2/2] (ln2 split in two, so r is exact), e^r by its degree-7 Taylor polynomial
   (truncation under 6e-9 there). scalef takes large negative n to 0 and denormals as expf does. A call to expf per
   score was the kernel's largest cost after the K/V reads. */
static inline __m512 exp16(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* row[t] = e^(row[t] - max(row)) for t < n, rounded to bf16 where `round`; returns the sum of the unrounded
   values (SDPA divides by it at the end). */
static float softmax_weights(float *row, int64_t n, int round) {
    __m512 largest = _mm512_set1_ps(-INFINITY), total = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) largest = _mm512_mask_max_ps(largest, lanes(n - t), largest, _mm512_loadu_ps(row + t));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(largest));
    for (int64_t t = 0; t < n; t += 16) {
        const __mmask16 m = lanes(n - t);
        const __m512 weight = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + t), top));
        total = _mm512_mask_add_ps(total, m, total, weight);
        __m512 kept = weight;
        if (round)  /* round to nearest even bf16, as to_bf16 (the weights are finite and positive) */
            kept = _mm512_castsi512_ps(_mm512_and_si512(
                _mm512_add_epi32(_mm512_castps_si512(weight),
                                 _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                  _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(weight), 16),
                                                                   _mm512_set1_epi32(1)))),
                _mm512_set1_epi32((int)0xffff0000u)));
        _mm512_mask_storeu_ps(row + t, m, kept);
    }
    return _mm512_reduce_add_ps(total);
}

/* Lane t of the result: the sum of acc[t]'s 16 lanes. A tree of 15 adds (and the shuffles that pair lanes)
   for 16 dot products, where a horizontal sum for each would cost 16 reductions of 4 steps each; what comes
   out holds token 4j + k at lane 4k + j, which the last permute puts in order. */
static inline __m512 sum16(const __m512 *acc) {
    __m512 b[8], c[4], d[2];
    for (int k = 0; k < 8; ++k)
        b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * k], acc[2 * k + 1], 0x44),
                             _mm512_shuffle_f32x4(acc[2 * k], acc[2 * k + 1], 0xEE));
    for (int m = 0; m < 4; ++m)
        c[m] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0xDD));
    for (int n = 0; n < 2; ++n)
        d[n] = _mm512_add_ps(_mm512_unpacklo_ps(c[2 * n], c[2 * n + 1]), _mm512_unpackhi_ps(c[2 * n], c[2 * n + 1]));
    const __m512d low = _mm512_unpacklo_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]));
    const __m512d high = _mm512_unpackhi_pd(_mm512_castps_pd(d[0]), _mm512_castps_pd(d[1]));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
                                 _mm512_add_ps(_mm512_castpd_ps(low), _mm512_castpd_ps(high)));
}

/* scores[r] = (q . rows[r]) * scale for the n <= 16 rows (rows past n repeat a real one, never stored). */
static inline __attribute__((always_inline)) void score16(const char *const *rows, int64_t offset, const void *q,
                                                          int64_t dim, int is_bf16, float scale, float *scores,
                                                          int64_t n) {
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    if (is_bf16) {
        for (int64_t k = 0; k < dim; k += 32) {
            const __m512bh qs = load_bh((const bf16 *)q + k, dim - k);
            for (int r = 0; r < 16; ++r)
                acc[r] = _mm512_dpbf16_ps(acc[r], load_bh((const bf16 *)(rows[r] + offset) + k, dim - k), qs);
        }
    } else {
        for (int64_t k = 0; k < dim; k += 16) {
            const __m512 qs = load_lanes(q, k, dim - k, 0);
            for (int r = 0; r < 16; ++r) acc[r] = _mm512_fmadd_ps(load_lanes(rows[r] + offset, k, dim - k, 0), qs, acc[r]);
        }
    }
    _mm512_mask_storeu_ps(scores, lanes(n), _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
}

/* For `heads` (1 or 2) query heads k of one KV head: sums[k * head_dim + j] += weights[k * context + r] *
   rows[r][j] for the n rows and j < dim (<= 128), the sums held in registers and each row widened once for both. */
static inline __attribute__((always_inline)) void accumulate16(const char *const *rows, int64_t offset, int64_t n,
                                                               const float *weights, int64_t context, float *sums,
                                                               int64_t head_dim, int64_t dim, int is_bf16, int heads) {
    __m512 acc[2][8];
    const int64_t chunks = (dim + 15) / 16;
    for (int k = 0; k < heads; ++k)
        for (int64_t c = 0; c < chunks; ++c) acc[k][c] = _mm512_maskz_loadu_ps(lanes(dim - 16 * c), sums + k * head_dim + 16 * c);
    for (int64_t r = 0; r < n; ++r) {
        __m512 weight[2];
        for (int k = 0; k < heads; ++k) weight[k] = _mm512_set1_ps(weights[k * context + r]);
        for (int64_t c = 0; c < chunks; ++c) {
            const __m512 value = load_lanes(rows[r] + offset, 16 * c, dim - 16 * c, is_bf16);
            for (int k = 0; k < heads; ++k) acc[k][c] = _mm512_fmadd_ps(weight[k], value, acc[k][c]);
        }
    }
    for (int k = 0; k < heads; ++k)
        for (int64_t c = 0; c < chunks; ++c) _mm512_mask_storeu_ps(sums + k * head_dim + 16 * c, lanes(dim - 16 * c), acc[k][c]);
}

/* The cache is read through the block table, 16 tokens at a time: `rows` gets each token's slot (its KV heads
   from `first` on), rows past the context repeat the first. A block's rows are contiguous, so within one the
   hardware prefetcher streams them; the next block (anywhere in the cache, last written a step ago and since
   evicted) is fetched as a block is entered. */
typedef struct {
    const char *base;  /* the layer's K or V cache, at KV head `first` of slot 0 */
    const int32_t *table;
    int64_t block_bytes, row_bytes, width_bytes, block_size, context, block, offset;
} page_walk;

static inline void fetch_block(const page_walk *w, int64_t block) {
    const int64_t remaining = w->context - block * w->block_size;
    const int64_t rows = remaining < w->block_size ? remaining : w->block_size;
    const char *first_row = w->base + w->table[block] * w->block_bytes;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < w->width_bytes; i += 64) _mm_prefetch(first_row + r * w->row_bytes + i, _MM_HINT_T0);
}

#ifndef AHEAD
#define AHEAD 2
#endif
static inline void next_rows(page_walk *w, const char **rows, int64_t n) {
    for (int64_t r = 0; r < 16; ++r) {
        if (r >= n) {
            rows[r] = rows[0];
            continue;
        }
        if (w->offset == 0)  /* entering a block: fetch the one AHEAD on (and at the start, those before it) */
            for (int64_t b = w->block == 0 ? 1 : AHEAD; b <= AHEAD && (w->block + b) * w->block_size < w->context; ++b)
                fetch_block(w, w->block + b);
        rows[r] = w->base + w->table[w->block] * w->block_bytes + w->offset * w->row_bytes;
        if (++w->offset == w->block_size) w->offset = 0, ++w->block;
    }
}

/* Attention of the query heads of KV heads [first, last) over a sequence's pages, as SDPA's CPU kernel
   computes it: scores in float32, the softmax weights (in bf16, rounded to bf16) weighting V, the sum of the
   unrounded weights dividing at the end. `queries`/`out`: the token's head 0; `scores`: (last - first) *
   group * context floats; `sums`: (last - first) * group * head_dim floats. Inlined for each dtype and the
   common head sizes, so that the loops over a head's vectors unroll into registers. */
static inline __attribute__((always_inline)) void attend_as(
        const attention_shape *a, const void *queries, const void *k_layer, const void *v_layer, const int32_t *table,
        int64_t context, int64_t first, int64_t last, float *scores, float *sums, void *out, int is_bf16, int64_t dim) {
    const int64_t size = is_bf16 ? 2 : 4, group = a->heads / a->kv_heads, heads = (last - first) * group;
    const int64_t row_bytes = a->kv_heads * dim * size;
    const char *q = (const char *)queries + first * group * dim * size;
    const page_walk start = {NULL, table, a->block_size * row_bytes, row_bytes, (last - first) * dim * size,
                             a->block_size, context, 0, 0};
    const char *rows[16];
    page_walk keys = start;
    keys.base = (const char *)k_layer + first * dim * size;
    for (int64_t t = 0; t < context; t += 16) {
        const int64_t n = context - t < 16 ? context - t : 16;
        next_rows(&keys, rows, n);
        for (int64_t h = 0; h < heads; ++h)
            score16(rows, h / group * dim * size, q + h * dim * size, dim, is_bf16, a->scale, scores + h * context + t, n);
    }
    float totals[heads];
    for (int64_t h = 0; h < heads; ++h) totals[h] = softmax_weights(scores + h * context, context, is_bf16);
    for (int64_t i = 0; i < heads * dim; ++i) sums[i] = 0.0f;
    page_walk values = start;
    values.base = (const char *)v_layer + first * dim * size;
    for (int64_t t = 0; t < context; t += 16) {
        const int64_t n = context - t < 16 ? context - t : 16;
        next_rows(&values, rows, n);
        for (int64_t h = 0; h < heads; h += group % 2 == 0 ? 2 : 1)  /* query heads of a KV head in pairs, if even */
            for (int64_t part = 0; part < dim; part += 128) {  /* registers for 128 of a head's sums at a time */
                const int64_t offset = (h / group * dim + part) * size, width = dim - part < 128 ? dim - part : 128;
                if (group % 2 == 0)
                    accumulate16(rows, offset, n, scores + h * context + t, context, sums + h * dim + part, dim,
                                 width, is_bf16, 2);
                else
                    accumulate16(rows, offset, n, scores + h * context + t, context, sums + h * dim + part, dim,
                                 width, is_bf16, 1);
            }
    }
    for (int64_t h = 0; h < heads; ++h) {
        const float inverse = 1.0f / totals[h];
        const int64_t head = first * group + h;
        for (int64_t j = 0; j < dim; ++j) {
            const float value = sums[h * dim + j] * inverse;
            if (is_bf16) ((bf16 *)out)[head * dim + j] = to_bf16(value);
            else ((float *)out)[head * dim + j] = value;
        }
    }
}

static void attend(const attention_shape *a, const void *queries, const void *k_layer, const void *v_layer,
                   const int32_t *table, int64_t context, int64_t first, int64_t last, float *scores, float *sums,
                   void *out) {
#define ATTEND(is_bf16, dim) attend_as(a, queries, k_layer, v_layer, table, context, first, last, scores, sums, out, is_bf16, dim)
    if (a->bf16) {
        if (a->head_dim == 64) ATTEND(1, 64);
        else if (a->head_dim == 128) ATTEND(1, 128);
        else ATTEND(1, a->head_dim);
    } else {
        if (a->head_dim == 64) ATTEND(0, 64);
        else if (a->head_dim == 128) ATTEND(0, 128);
        else ATTEND(0, a->head_dim);
    }
#undef ATTEND
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
        const attention_shape shape = {d->heads, d->kv_heads, d->head_dim, d->block_size, (float)d->scale, 1};
        attend(&shape, m->qkv, k_layer, v_layer, s->block_table, context, first, last,
               m->scores + first * group * context, m->sums + first * group * d->head_dim, m->attended);
    }
#pragma omp barrier
    product(w[W_O], w[W_O_BIAS], m->attended, m->hidden, d->hidden, q_width);
    add_into(residual, m->hidden, d->hidden);
    rms_norm(residual, w[W_POST_NORM], normed, d->hidden, (float)d->eps);
    product(w[W_GATE_UP], w[W_GATE_UP_BIAS], normed, m->gate_up, 2 * d->intermediate, d->hidden);
    silu_and_mul(m->gate_up, m->act, d->intermediate);
    product(w[W_DOWN], w[W_DOWN_BIAS], m->act, m->hidden, d->hidden, d->intermediate);
}

/* The forward: `embedded` [hidden] is the token's embedding row; `out` [hidden], where given, receives the
   final norm of the residual stream (what `LlamaFamilyForCausalLM.forward` returns), and `logits` [vocab],
   where given, the output head `head` [vocab, hidden] (+ `head_bias`) applied to it, widened to float32 (what
   `compute_logits` returns): in the same parallel region as the layers, so the head's stream follows the
   last layer's without the team ending and a second call starting. The layer's K/V go into `kv`
   [2 * layers, num_blocks, block_size, kv_heads, head_dim] at the step's slot. */
int veil_decode_one(const veil_dims *d, const bf16 *const *weights, const bf16 *final_norm, bf16 *kv,
                    const bf16 *cos_cache, const bf16 *sin_cache, const veil_step *s, const bf16 *embedded,
                    bf16 *out, const bf16 *head, const bf16 *head_bias, float *logits) {
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
        /* Every thread its own final norm (as each layer's norms): the head's rows need all of it. */
        bf16 *residual = m.residual + omp_get_thread_num() * m.row, *normed = m.normed + omp_get_thread_num() * m.row;
        add_into(residual, m.hidden, d->hidden);
        rms_norm(residual, final_norm, normed, d->hidden, (float)d->eps);
        if (out && omp_get_thread_num() == 0) memcpy(out, normed, sizeof(bf16) * (size_t)d->hidden);
        if (logits) product_into(head, head_bias, normed, NULL, logits, d->vocab, d->hidden);
    }
    scratch_free(&m);
    return OK;
}

/* out[rows] = bf16(weight[rows, in] . x + bias) for one input row: the output head of a batch-1 decode. */
void veil_product(const bf16 *weight, const bf16 *bias, const bf16 *x, bf16 *out, int64_t rows, int64_t in,
                  int64_t threads) {
#pragma omp parallel num_threads((int)threads)
    product(weight, bias, x, out, rows, in);
}

/* ---- Attention of a step's new tokens (decode tokens and prefill chunks alike) over the paged cache ---- */

typedef struct {
    int64_t heads, kv_heads, head_dim, block_size, num_blocks, table_width, table_stride, seqs, tokens,
        query_stride, threads, bf16;
    double scale;
} veil_attention_dims;

/* The offsets must split the step's tokens among the sequences in order, none with more new tokens than its
   context; every block a sequence with new tokens reads must be in the cache. `longest`: the longest context. */
static int check_attention_step(const veil_attention_dims *d, const int32_t *query_offsets, const int32_t *tables,
                                const int32_t *contexts, int64_t *longest) {
    *longest = 0;
    if (query_offsets[0] != 0 || query_offsets[d->seqs] != d->tokens) return BAD_QUERY_OFFSETS;
    for (int64_t s = 0; s < d->seqs; ++s) {
        const int64_t context = contexts[s], new_tokens = query_offsets[s + 1] - query_offsets[s];
        if (new_tokens < 0) return BAD_QUERY_OFFSETS;
        if (new_tokens == 0) continue;  /* nothing of this sequence is read */
        if (context < new_tokens || context > d->table_width * d->block_size) return BAD_CONTEXT;
        for (int64_t b = 0; b < (context + d->block_size - 1) / d->block_size; ++b) {
            const int32_t block = tables[s * d->table_stride + b];
            if (block < 0 || block >= d->num_blocks) return BAD_BLOCK_ID;
        }
        *longest = context > *longest ? context : *longest;
    }
    return OK;
}

/* out[i] = attention of the step's token i, query[i] (rows `query_stride` elements apart), over its
   sequence's cache up to and including its own position, read in place through the sequence's block table
   row: no gathered copy, no padding to the longest context and no mask, which the eager kernel pays in every
   layer. Work items are a token's KV heads, or parts of them where there are fewer tokens than threads to keep
   busy; the threads take them as they finish (contexts differ in length). Each item is summed by one thread in
   a fixed order, so results do not depend on the thread count. */
int veil_paged_attention(const veil_attention_dims *d, const void *query, const void *k_cache, const void *v_cache,
                         const int32_t *tables, const int32_t *contexts, const int32_t *query_offsets, void *out) {
    int64_t longest;
    const int status = check_attention_step(d, query_offsets, tables, contexts, &longest);
    if (status != OK || d->tokens == 0) return status;
    const attention_shape shape = {d->heads, d->kv_heads, d->head_dim, d->block_size, (float)d->scale, (int)d->bf16};
    const int64_t size = d->bf16 ? 2 : 4, group = d->heads / d->kv_heads;
    const int64_t wanted = (2 * d->threads + d->tokens - 1) / d->tokens;  /* parts per token */
    const int64_t parts = wanted < 1 ? 1 : wanted > d->kv_heads ? d->kv_heads : wanted;
    const int64_t widest = (d->kv_heads + parts - 1) / parts * group;  /* query heads in the largest part */
    const int64_t per_thread = widest * (longest + d->head_dim);
    const size_t bytes = sizeof(float) * (size_t)(per_thread * d->threads);
    float *scratch = calloc(1, bytes);
    int32_t *owner = malloc(sizeof(int32_t) * (size_t)d->tokens);  /* each token's sequence */
    if (!scratch || !owner) {
        free(scratch);
        free(owner);
        return NO_MEMORY;
    }
    for (int64_t s = 0; s < d->seqs; ++s)
        for (int64_t i = query_offsets[s]; i < query_offsets[s + 1]; ++i) owner[i] = (int32_t)s;
#pragma omp parallel num_threads((int)d->threads)
    {
        float *scores = scratch + omp_get_thread_num() * per_thread, *sums = scores + widest * longest;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < d->tokens * parts; ++item) {
            const int64_t i = item / parts, part = item % parts, s = owner[i];
            const int64_t visible = contexts[s] - (query_offsets[s + 1] - i) + 1;  /* positions 0 .. its own */
            attend(&shape, (const char *)query + i * d->query_stride * size, k_cache, v_cache,
                   tables + s * d->table_stride, visible, d->kv_heads * part / parts,
                   d->kv_heads * (part + 1) / parts, scores, sums, (char *)out + i * d->heads * d->head_dim * size);
        }
    }
    explicit_bzero(scratch, bytes);  /* scores of this step's requests: zeroed before the allocator reuses them */
    free(scratch);
    free(owner);
    return OK;
}
