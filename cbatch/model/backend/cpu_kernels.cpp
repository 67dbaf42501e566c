// The CPU path's compiled kernels: paged decode attention (one query token per row, K and V read in place
// from the block cache), the fused RMSNorm (with the residual add) and SiLU-and-multiply, and the KV store.
//
// Built at first use by cpu_kernels.py (the system C++ compiler, OpenMP from the torch process) and called
// through ctypes: plain pointers and sizes, no torch headers (it compiles in about a second).
//
// Decode attention shapes (row-major, elements):
//   q           [num_tokens, Hq, D]            row stride q_row_stride, head stride D
//   out         [num_tokens, Hq, D]            contiguous
//   k/v cache   [num_blocks, block_size, Hkv, D] contiguous
//   block_table int32 [B, table_stride]
//   seq_lens    int32 [B]                      context length, this token included
//   rows        int32 [n]: the batch index b of each decode row; its query is flat row query_start[b]
//   query_start int32 [B + 1]
// Query heads h*G .. h*G+G-1 share KV head h (G = Hq / Hkv). Scores are computed in float32 whatever the
// storage dtype (float32 or bfloat16), softmax in float32, and the output rounded once to the storage dtype.
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CBATCH_DOTS8 1  // decode's eight-token dot products below (x86-64-v3 and v4 builds)
#endif

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {  // bfloat16 bits -> float32
    uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}
inline void store(float* p, int64_t i, float x) { p[i] = x; }
// x's bits rounded to bfloat16's (nearest even, as torch), in the top half; a NaN stays NaN (its quiet bit set).
// Branch-free and in registers, so that the loops around it vectorize.
inline uint32_t bfloat16_bits(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    const uint32_t nearest = bits + 0x7fffu + ((bits >> 16) & 1u);
    return ((bits & 0x7fffffffu) > 0x7f800000u ? bits | 0x400000u : nearest) & 0xffff0000u;
}
inline void store(uint16_t* p, int64_t i, float x) { p[i] = static_cast<uint16_t>(bfloat16_bits(x) >> 16); }

// x rounded to T's precision, as a store to T and a load back would (float32: x itself).
template <typename T> inline float rounded(float x);
template <> inline float rounded<float>(float x) { return x; }
template <> inline float rounded<uint16_t>(float x) {
    const uint32_t bits = bfloat16_bits(x);
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// exp(x) in a form the compiler vectorizes (the libm call does not): x = n ln2 + r with |r| <= ln2 / 2,
// exp(r) by a degree-6 minimax polynomial (Cephes' expf coefficients, about 1 ulp), times 2^n built in the
// exponent bits. Below -87 the result is 0 and above 88 infinity, as expf's (to within its denormals).
inline float exp_approx(float x) {
    const float clamped = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = std::nearbyint(clamped * 1.44269504088896341f);
    const float r = (clamped - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 in two parts: r is exact
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, sizeof two_n);
    return x < -87.0f ? 0.0f : (x > 88.0f ? INFINITY : y * two_n);
}

#ifdef CBATCH_DOTS8
// Lane j of the result: the sum of a[j]'s eight lanes. Eight dot products' horizontal sums in six hadds, two
// 128-bit permutes and an add (one at a time would take about five shuffles and adds each): hadd pairs
// neighbours within each 128-bit half, twice, which leaves a[0..3]'s half-sums in one register and a[4..7]'s in
// the other; adding the matching 128-bit halves finishes them.
inline __m256 sum_lanes8(const __m256* a) {
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// scores[0..7] = scale * (q . k_j) for the eight keys k_j = keys + j * key_stride (HEAD_DIM floats each, a
// multiple of 8): eight accumulators in registers, then one transposed sum.
template <int HEAD_DIM>
inline void dots8(const float* q, const float* keys, int64_t key_stride, float scale, float* scores) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int d = 0; d < HEAD_DIM; d += 8) {
        const __m256 x = _mm256_loadu_ps(q + d);
        for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(x, _mm256_loadu_ps(keys + j * key_stride + d), acc[j]);
    }
    _mm256_storeu_ps(scores, _mm256_mul_ps(sum_lanes8(acc), _mm256_set1_ps(scale)));
}
#endif

// Asks the caches for one KV head's rows of a block (block_size rows of head_dim, token_stride apart).
template <typename T>
inline void prefetch_block(const T* block, int32_t block_size, int64_t token_stride, int32_t head_dim) {
    const int32_t line = 64 / static_cast<int32_t>(sizeof(T));
    for (int32_t t = 0; t < block_size; ++t)
        for (int32_t d = 0; d < head_dim; d += line) __builtin_prefetch(block + t * token_stride + d, 0, 3);
}

// One (row, KV head): the G query heads of that KV head against the row's context. HEAD_DIM > 0 is the head
// dimension known at compile time (the inner loops unroll to whole vectors); 0 reads it from `head_dim`.
template <typename T, int HEAD_DIM>
void decode_one(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache, const int32_t* table,
                int32_t ctx, int32_t row, int32_t kv_head, T* out, int32_t num_heads, int32_t num_kv_heads,
                int32_t runtime_head_dim, int32_t block_size, float scale, int32_t sliding_window, float softcap,
                const float* sinks, std::vector<float>& scratch) {
    const int32_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : runtime_head_dim;
    const int32_t group = num_heads / num_kv_heads;
    const int32_t first = (sliding_window > 0 && ctx > sliding_window) ? ctx - sliding_window : 0;
    const int32_t span = ctx - first;
    // scratch: queries [G, D] | 1 / softmax sums [G] | scores [G, span]
    scratch.resize(static_cast<size_t>(group) * (head_dim + 1 + span));
    float* qf = scratch.data();
    float* inv_sum = qf + group * head_dim;
    float* scores = inv_sum + group;
    for (int32_t g = 0; g < group; ++g) {
        const T* src = q + static_cast<int64_t>(row) * q_row_stride + static_cast<int64_t>(kv_head * group + g) * head_dim;
        for (int32_t d = 0; d < head_dim; ++d) qf[g * head_dim + d] = load(src, d);
    }
    const int64_t token_stride = static_cast<int64_t>(num_kv_heads) * head_dim;
    const T* k_head = k_cache + static_cast<int64_t>(kv_head) * head_dim;
    const T* v_head = v_cache + static_cast<int64_t>(kv_head) * head_dim;
    // the first block's rows of this head, before the queries are loaded
    prefetch_block(k_head + static_cast<int64_t>(table[first / block_size]) * block_size * token_stride,
                   block_size, token_stride, head_dim);
    // pass 1: scores[g, t] = q_g . k_t, block by block (each block's tokens are token_stride apart)
    for (int32_t t0 = first - first % block_size; t0 < ctx; t0 += block_size) {
        const T* k_block = k_head + static_cast<int64_t>(table[t0 / block_size]) * block_size * token_stride;
        if (t0 + block_size < ctx)  // the next block lies elsewhere in the pool: fetch its rows while this one computes
            prefetch_block(k_head + static_cast<int64_t>(table[t0 / block_size + 1]) * block_size * token_stride,
                           block_size, token_stride, head_dim);
        const int32_t lo = t0 < first ? first : t0, hi = t0 + block_size < ctx ? t0 + block_size : ctx;
        int32_t t = lo;
#ifdef CBATCH_DOTS8
        if constexpr (HEAD_DIM > 0 && HEAD_DIM % 8 == 0) {
            for (; t + 8 <= hi; t += 8) {  // eight tokens at once, their sums transposed into one vector
                const T* k_first = k_block + static_cast<int64_t>(t - t0) * token_stride;
                const float* keys;
                int64_t key_stride;
                float converted[8 * (HEAD_DIM > 0 ? HEAD_DIM : 8)];
                if constexpr (std::is_same_v<T, float>) {
                    keys = k_first, key_stride = token_stride;
                } else {  // converted once here, not once per query head
                    for (int32_t j = 0; j < 8; ++j)
#pragma omp simd
                        for (int32_t d = 0; d < HEAD_DIM; ++d)
                            converted[j * HEAD_DIM + d] = load(k_first + j * token_stride, d);
                    keys = converted, key_stride = HEAD_DIM;
                }
                for (int32_t g = 0; g < group; ++g)
                    dots8<HEAD_DIM>(qf + g * HEAD_DIM, keys, key_stride, scale, scores + g * span + (t - first));
            }
        }
#endif
        for (; t + 4 <= hi; t += 4) {  // four tokens at once: four independent dot products in flight
            const float *k0, *k1, *k2, *k3;
            float converted[4 * (HEAD_DIM > 0 ? HEAD_DIM : 512)];
            const T* k_first = k_block + static_cast<int64_t>(t - t0) * token_stride;
            if constexpr (std::is_same_v<T, float>) {
                k0 = k_first, k1 = k0 + token_stride, k2 = k1 + token_stride, k3 = k2 + token_stride;
            } else {  // converted once here, not once per query head
                for (int32_t j = 0; j < 4; ++j)
#pragma omp simd
                    for (int32_t d = 0; d < head_dim; ++d)
                        converted[j * head_dim + d] = load(k_first + j * token_stride, d);
                k0 = converted, k1 = k0 + head_dim, k2 = k1 + head_dim, k3 = k2 + head_dim;
            }
            for (int32_t g = 0; g < group; ++g) {
                const float* qg = qf + g * head_dim;
                float d0 = 0.0f, d1 = 0.0f, d2 = 0.0f, d3 = 0.0f;
#pragma omp simd reduction(+ : d0, d1, d2, d3)
                for (int32_t d = 0; d < head_dim; ++d) {
                    const float x = qg[d];
                    d0 += x * k0[d];
                    d1 += x * k1[d];
                    d2 += x * k2[d];
                    d3 += x * k3[d];
                }
                float* out_g = scores + g * span + (t - first);
                out_g[0] = d0 * scale, out_g[1] = d1 * scale, out_g[2] = d2 * scale, out_g[3] = d3 * scale;
            }
        }
        for (; t < hi; ++t) {
            const T* k = k_block + static_cast<int64_t>(t - t0) * token_stride;
            for (int32_t g = 0; g < group; ++g) {
                const float* qg = qf + g * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int32_t d = 0; d < head_dim; ++d) dot += qg[d] * load(k, d);
                scores[g * span + (t - first)] = dot * scale;
            }
        }
    }
    if (softcap > 0.0f)  // HF's order: softcap * tanh(scale * q.k / softcap)
        for (int64_t i = 0; i < static_cast<int64_t>(group) * span; ++i)
            scores[i] = softcap * std::tanh(scores[i] / softcap);
    // pass 2: softmax over each head's scores (max subtracted), in float32; a sink (gpt-oss) joins the max and
    // the sum as one more score without a value
    for (int32_t g = 0; g < group; ++g) {
        float* s = scores + g * span;
        const float sink = sinks != nullptr ? sinks[kv_head * group + g] : -INFINITY;
        float mx = sink;
#pragma omp simd reduction(max : mx)
        for (int32_t i = 0; i < span; ++i) mx = s[i] > mx ? s[i] : mx;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int32_t i = 0; i < span; ++i) {
            s[i] = exp_approx(s[i] - mx);
            sum += s[i];
        }
        if (sinks != nullptr) sum += exp_approx(sink - mx);
        inv_sum[g] = 1.0f / sum;
    }
    // pass 3: out_g = sum_t p[g, t] v_t, one query head at a time (its accumulator stays in registers)
    T* dst = out + static_cast<int64_t>(row) * num_heads * head_dim + static_cast<int64_t>(kv_head) * group * head_dim;
    for (int32_t g = 0; g < group; ++g) {
        const float* p = scores + g * span;
        float acc[HEAD_DIM > 0 ? HEAD_DIM : 512] = {};
        for (int32_t t0 = first - first % block_size; t0 < ctx; t0 += block_size) {
            const T* v_block = v_head + static_cast<int64_t>(table[t0 / block_size]) * block_size * token_stride;
            if (g == 0 && t0 + block_size < ctx)
                prefetch_block(v_head + static_cast<int64_t>(table[t0 / block_size + 1]) * block_size * token_stride,
                               block_size, token_stride, head_dim);
            const int32_t lo = t0 < first ? first : t0, hi = t0 + block_size < ctx ? t0 + block_size : ctx;
            int32_t t = lo;
            for (; t + 4 <= hi; t += 4) {  // four tokens per pass over the accumulator
                const T* v0 = v_block + static_cast<int64_t>(t - t0) * token_stride;
                const T *v1 = v0 + token_stride, *v2 = v1 + token_stride, *v3 = v2 + token_stride;
                const float w0 = p[t - first], w1 = p[t + 1 - first], w2 = p[t + 2 - first], w3 = p[t + 3 - first];
#pragma omp simd
                for (int32_t d = 0; d < head_dim; ++d)
                    acc[d] += (w0 * load(v0, d) + w1 * load(v1, d)) + (w2 * load(v2, d) + w3 * load(v3, d));
            }
            for (; t < hi; ++t) {
                const T* v = v_block + static_cast<int64_t>(t - t0) * token_stride;
                const float w = p[t - first];
#pragma omp simd
                for (int32_t d = 0; d < head_dim; ++d) acc[d] += w * load(v, d);
            }
        }
        for (int32_t d = 0; d < head_dim; ++d) store(dst, g * head_dim + d, acc[d] * inv_sum[g]);
    }
}

template <typename T>
void decode(const T* q, int64_t q_row_stride, const T* k_cache, const T* v_cache, const int32_t* block_table,
            int64_t table_stride, const int32_t* seq_lens, const int32_t* query_start, const int32_t* rows,
            int32_t num_rows, T* out, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
            float scale, int32_t sliding_window, float softcap, const float* sinks, int32_t num_threads) {
    // the common head sizes unrolled at compile time; any other through the generic loop
    auto* attend = head_dim == 64 ? &decode_one<T, 64> : head_dim == 128 ? &decode_one<T, 128> : &decode_one<T, 0>;
    // one task per row, its KV heads in turn: the heads of a token share cache lines (token-major blocks), so
    // the row's K and V come from memory once (a task per (row, head) fetched them about Hkv times)
#pragma omp parallel num_threads(num_threads)
    {
        std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
        for (int32_t i = 0; i < num_rows; ++i) {
            const int32_t b = rows[i];
            for (int32_t kv_head = 0; kv_head < num_kv_heads; ++kv_head)
                attend(q, q_row_stride, k_cache, v_cache, block_table + b * table_stride, seq_lens[b], query_start[b],
                       kv_head, out, num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window, softcap,
                       sinks, scratch);
        }
    }
}

// Causal attention of prefill chunks: chunk p is flat rows starts[p] .. starts[p] + lens[p] - 1 of q [T, Hq, D],
// k and v [T, Hkv, D] (row strides q/k/v_row_stride, heads contiguous), after cached[p] tokens of its sequence
// already in the paged cache (k/v_cache [num_blocks, block_size, Hkv, D], that sequence's block table row
// block_table + table_rows[p] * table_stride; 0 for a fresh prompt); out [T, Hq, D] contiguous. Every query
// row's sums run over key panels counted from the sequence's first token, in one order: a row's result depends
// only on its sequence's keys and values up to it, the same bits in any batch and under any chunking. Scores and
// softmax in float32. key_ends (Gemma 3's images; int32 [T] or null): the position before which flat row t's keys
// end, instead of its own position + 1 (an image token sees its whole image).
// One vector register of floats, loaded and stored at any float alignment: 16 with AVX-512, else 8.
#if defined(__AVX512F__)
constexpr int32_t VEC = 16;
#else
constexpr int32_t VEC = 8;
#endif
typedef float vecf __attribute__((vector_size(VEC * 4), aligned(4)));
constexpr int32_t PREFILL_KEYS = 2 * VEC;     // keys per score tile: the transposed K panel's width
constexpr int32_t PREFILL_ROWS = 4;      // query rows per tile (a token's heads of one KV head, then the next token's)
constexpr int32_t PREFILL_TOKENS = 128;  // query tokens per task: a long prompt's work spreads over threads
constexpr int32_t PREFILL_OUT_DIMS = 2 * VEC; // output dims accumulated at once (the accumulators stay in registers)

struct PrefillScratch {
    std::vector<float> k_panels;  // [ceil(keys / PREFILL_KEYS), D, PREFILL_KEYS]: K transposed, zero past the keys
    std::vector<float> values;    // [keys, D rounded up to VEC]: zero past D
    std::vector<float> queries;   // [PREFILL_ROWS, D]
    std::vector<float> probs;     // [PREFILL_ROWS, the task's keys rounded up to PREFILL_KEYS]
};

// Where a chunk's keys come from: its first `cached` positions in the paged cache, the rest its own flat rows.
template <typename T>
struct ChunkKeys {
    const T *k, *v;  // the step's flat keys/values, row strides below
    int64_t k_row_stride, v_row_stride;
    int32_t start, cached;  // the chunk's first flat row; tokens before it in the cache
    const T *k_cache, *v_cache;
    const int32_t* table;  // the sequence's block table row (read only below `cached`)
    int32_t block_size;

    // key/value j (a position in the sequence) of kv head h, D wide
    const T* key(int32_t j, int32_t h, int32_t num_kv_heads, int32_t head_dim) const {
        return at(k, k_row_stride, k_cache, j, h, num_kv_heads, head_dim);
    }
    const T* value(int32_t j, int32_t h, int32_t num_kv_heads, int32_t head_dim) const {
        return at(v, v_row_stride, v_cache, j, h, num_kv_heads, head_dim);
    }

  private:
    const T* at(const T* flat, int64_t row_stride, const T* cache, int32_t j, int32_t h, int32_t num_kv_heads,
                int32_t head_dim) const {
        if (j >= cached) return flat + static_cast<int64_t>(start + j - cached) * row_stride + static_cast<int64_t>(h) * head_dim;
        const int64_t slot = static_cast<int64_t>(table[j / block_size]) * block_size + j % block_size;
        return cache + (slot * num_kv_heads + h) * head_dim;
    }
};

// One task: the queries of chunk tokens first_token .. last_token - 1 against KV head kv_head. A query at sequence
// position i sees keys first_key(i) .. key_end(i) - 1: i + 1 unless key_ends (this chunk's rows, or null) says
// further (sliding_window > 0: no key sliding_window or more before i); softcap > 0:
// scores softcap * tanh(score / softcap) (Gemma 2), before the mask as HF; sinks (gpt-oss, [Hq], or null): each
// head's logit joins its rows' max and sum as one more score without a value.
template <typename T, int HEAD_DIM>
void prefill_task(const T* q, int64_t q_row_stride, const ChunkKeys<T>& src, const int32_t* key_ends, T* out,
                  int32_t first_token, int32_t last_token, int32_t kv_head, int32_t num_heads, int32_t num_kv_heads,
                  int32_t runtime_head_dim, float scale, int32_t sliding_window, float softcap, const float* sinks,
                  PrefillScratch& s) {
    const int32_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : runtime_head_dim;
    const int32_t group = num_heads / num_kv_heads;
    const int32_t start = src.start, cached = src.cached;
    auto first_key = [sliding_window](int32_t pos) {
        return sliding_window > 0 && pos >= sliding_window ? pos + 1 - sliding_window : 0;
    };
    auto key_end = [key_ends, cached](int32_t token) {  // of the query at chunk token `token`
        return key_ends != nullptr ? key_ends[token] : cached + token + 1;
    };
    auto panel_start = [](int32_t key) { return key / PREFILL_KEYS * PREFILL_KEYS; };
    // the task's keys key0 .. last_key - 1; panels counted from the sequence's first token
    int32_t last_key = 0;
    for (int32_t t = first_token; t < last_token; ++t) last_key = std::max(last_key, key_end(t));
    const int32_t key0 = panel_start(first_key(cached + first_token));
    const int32_t keys = last_key - key0;
    const int32_t panels = (keys + PREFILL_KEYS - 1) / PREFILL_KEYS;
    const int32_t padded = panels * PREFILL_KEYS;
    s.k_panels.assign(static_cast<size_t>(panels) * head_dim * PREFILL_KEYS, 0.0f);
    const int32_t padded_dim = (head_dim + VEC - 1) / VEC * VEC;
    s.values.assign(static_cast<size_t>(keys) * padded_dim, 0.0f);
    s.queries.resize(static_cast<size_t>(PREFILL_ROWS) * head_dim);
    s.probs.resize(static_cast<size_t>(PREFILL_ROWS) * padded);
    for (int32_t jj = 0; jj < keys; ++jj) {  // key key0 + jj at panel jj / PREFILL_KEYS
        const T* kj = src.key(key0 + jj, kv_head, num_kv_heads, head_dim);
        const T* vj = src.value(key0 + jj, kv_head, num_kv_heads, head_dim);
        float* panel = s.k_panels.data() + static_cast<size_t>(jj / PREFILL_KEYS) * head_dim * PREFILL_KEYS + jj % PREFILL_KEYS;
        for (int32_t d = 0; d < head_dim; ++d) panel[d * PREFILL_KEYS] = load(kj, d);
        for (int32_t d = 0; d < head_dim; ++d) s.values[static_cast<size_t>(jj) * padded_dim + d] = load(vj, d);
    }
    // query rows in (token, head) order; a tile is PREFILL_ROWS consecutive rows, its keys those of its last token
    const int64_t total_rows = static_cast<int64_t>(last_token - first_token) * group;
    for (int64_t row0 = 0; row0 < total_rows; row0 += PREFILL_ROWS) {
        const int32_t rows = static_cast<int32_t>(total_rows - row0 < PREFILL_ROWS ? total_rows - row0 : PREFILL_ROWS);
        int32_t token_of[PREFILL_ROWS], head_of[PREFILL_ROWS];
        for (int32_t r = 0; r < PREFILL_ROWS; ++r) {  // rows past the end repeat the last one (computed, not stored)
            const int64_t row = row0 + (r < rows ? r : rows - 1);
            token_of[r] = first_token + static_cast<int32_t>(row / group);
            head_of[r] = kv_head * group + static_cast<int32_t>(row % group);
            const T* src = q + static_cast<int64_t>(start + token_of[r]) * q_row_stride + static_cast<int64_t>(head_of[r]) * head_dim;
            for (int32_t d = 0; d < head_dim; ++d) s.queries[r * head_dim + d] = load(src, d);
        }
        // the tile's keys, relative to key0: from its first row's first panel to its rows' last key end
        const int32_t lo = panel_start(first_key(cached + token_of[0])) - key0;
        int32_t hi = 0;
        for (int32_t r = 0; r < PREFILL_ROWS; ++r) hi = std::max(hi, key_end(token_of[r]) - key0);
        const int32_t hi_padded = (hi + PREFILL_KEYS - 1) / PREFILL_KEYS * PREFILL_KEYS;
        const float* qf = s.queries.data();
        for (int32_t p = lo / PREFILL_KEYS; p < hi_padded / PREFILL_KEYS; ++p) {  // scores: acc[r] = q_r . k_j
            const float* panel = s.k_panels.data() + static_cast<size_t>(p) * head_dim * PREFILL_KEYS;
            vecf acc[PREFILL_ROWS][PREFILL_KEYS / VEC] = {};
            for (int32_t d = 0; d < head_dim; ++d) {
                const vecf* kd = reinterpret_cast<const vecf*>(panel + d * PREFILL_KEYS);
#pragma GCC unroll 8
                for (int32_t r = 0; r < PREFILL_ROWS; ++r) {
                    const float x = qf[r * head_dim + d];
#pragma GCC unroll 8
                    for (int32_t c = 0; c < PREFILL_KEYS / VEC; ++c) acc[r][c] += x * kd[c];
                }
            }
#pragma GCC unroll 8
            for (int32_t r = 0; r < PREFILL_ROWS; ++r)
#pragma GCC unroll 8
                for (int32_t c = 0; c < PREFILL_KEYS / VEC; ++c)
                    *reinterpret_cast<vecf*>(s.probs.data() + r * padded + p * PREFILL_KEYS + c * VEC) = acc[r][c] * scale;
        }
        float inv_sum[PREFILL_ROWS];
        for (int32_t r = 0; r < PREFILL_ROWS; ++r) {  // softmax over the row's own keys; 0 at the tile's others
            float* pr = s.probs.data() + r * padded;
            const int32_t own_lo = first_key(cached + token_of[r]) - key0, own_hi = key_end(token_of[r]) - key0;
            if (softcap > 0.0f)
                for (int32_t j = own_lo; j < own_hi; ++j) pr[j] = softcap * std::tanh(pr[j] / softcap);
            const float sink = sinks != nullptr ? sinks[head_of[r]] : -INFINITY;
            float mx = sink;
#pragma omp simd reduction(max : mx)
            for (int32_t j = own_lo; j < own_hi; ++j) mx = pr[j] > mx ? pr[j] : mx;
            for (int32_t j = lo; j < own_lo; ++j) pr[j] = 0.0f;
#pragma omp simd
            for (int32_t j = own_lo; j < own_hi; ++j) pr[j] = exp_approx(pr[j] - mx);
            for (int32_t j = own_hi; j < hi_padded; ++j) pr[j] = 0.0f;
            // the sum in whole vectors over panels counted from the sequence's first key, lanes added in order:
            // the same bits wherever the row's tile or task starts (leading panels add exact zeros)
            vecf lanes = {};
            for (int32_t j = lo; j < hi_padded; j += VEC) lanes += *reinterpret_cast<const vecf*>(pr + j);
            float sum = 0.0f;
            for (int32_t i = 0; i < VEC; ++i) sum += lanes[i];
            if (sinks != nullptr) sum += exp_approx(sink - mx);
            inv_sum[r] = 1.0f / sum;
        }
        // out_r = sum_j p[r, j] v_j / sum_r, PREFILL_OUT_DIMS dims at a time (whole vectors of the padded values)
        for (int32_t d0 = 0; d0 < padded_dim; d0 += PREFILL_OUT_DIMS) {
            const int32_t vecs = (padded_dim - d0 < PREFILL_OUT_DIMS ? padded_dim - d0 : PREFILL_OUT_DIMS) / VEC;
            vecf acc[PREFILL_ROWS][PREFILL_OUT_DIMS / VEC] = {};
            for (int32_t j = lo; j < hi; ++j) {
                const vecf* vj = reinterpret_cast<const vecf*>(s.values.data() + static_cast<size_t>(j) * padded_dim + d0);
#pragma GCC unroll 8
                for (int32_t r = 0; r < PREFILL_ROWS; ++r) {
                    const float w = s.probs[r * padded + j];
                    if (vecs == PREFILL_OUT_DIMS / VEC) {
#pragma GCC unroll 8
                        for (int32_t c = 0; c < PREFILL_OUT_DIMS / VEC; ++c) acc[r][c] += w * vj[c];
                    } else {
                        for (int32_t c = 0; c < vecs; ++c) acc[r][c] += w * vj[c];
                    }
                }
            }
            for (int32_t r = 0; r < rows; ++r) {
                T* dst = out + (static_cast<int64_t>(start + token_of[r]) * num_heads + head_of[r]) * head_dim + d0;
                for (int32_t d = 0; d < vecs * VEC && d0 + d < head_dim; ++d) store(dst, d, acc[r][d / VEC][d % VEC] * inv_sum[r]);
            }
        }
    }
}

template <typename T>
void prefill(const T* q, int64_t q_row_stride, const T* k, int64_t k_row_stride, const T* v, int64_t v_row_stride,
             const T* k_cache, const T* v_cache, const int32_t* block_table, int64_t table_stride, int32_t block_size,
             T* out, const int32_t* starts, const int32_t* lens, const int32_t* cached, const int32_t* table_rows,
             const int32_t* key_ends, int32_t num_chunks, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
             float scale, int32_t sliding_window, float softcap, const float* sinks, int32_t num_threads) {
    auto* attend = head_dim == 32    ? &prefill_task<T, 32>
                   : head_dim == 64  ? &prefill_task<T, 64>
                   : head_dim == 128 ? &prefill_task<T, 128>
                                     : &prefill_task<T, 0>;
    std::vector<ChunkKeys<T>> chunks;
    for (int32_t p = 0; p < num_chunks; ++p)
        chunks.push_back({k, v, k_row_stride, v_row_stride, starts[p], cached[p], k_cache, v_cache,
                          cached[p] > 0 ? block_table + static_cast<int64_t>(table_rows[p]) * table_stride : nullptr,
                          block_size});
    struct Task {
        int32_t chunk, first, last, kv_head;
        int64_t cost;  // query tokens x keys
    };
    std::vector<Task> tasks;  // the costliest first, so the threads finish together
    for (int32_t p = 0; p < num_chunks; ++p)
        for (int32_t first = 0; first < lens[p]; first += PREFILL_TOKENS)
            for (int32_t h = 0; h < num_kv_heads; ++h) {
                const int32_t last = first + PREFILL_TOKENS < lens[p] ? first + PREFILL_TOKENS : lens[p];
                tasks.push_back({p, first, last, h, static_cast<int64_t>(last - first) * (cached[p] + last)});
            }
    std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
    const int32_t n = static_cast<int32_t>(tasks.size());
#pragma omp parallel num_threads(num_threads) if (n > 1)
    {
        PrefillScratch scratch;
#pragma omp for schedule(dynamic, 1)
        for (int32_t i = 0; i < n; ++i) {
            const Task& t = tasks[i];
            attend(q, q_row_stride, chunks[t.chunk], key_ends != nullptr ? key_ends + starts[t.chunk] : nullptr, out,
                   t.first, t.last, t.kv_head, num_heads, num_kv_heads, head_dim, scale, sliding_window, softcap,
                   sinks, scratch);
        }
    }
}

// RMSNorm rows with HF's numerics: h = float(x) (x = x + residual first, rounded to the dtype, when given);
// h * 1 / sqrt(mean(h^2) + eps) rounded to the dtype, then times the weight in the dtype; with unit_offset
// (Gemma) h * inv * (1 + float(weight)), rounded once.
// x's rows come in groups of x_group_rows, x_stride apart within a group and x_group_stride between groups
// (a per-head view [T, H, D] of a packed projection: H rows D apart, tokens a projection row apart).
template <typename T>
void rms_norm(const T* x, int64_t x_stride, int64_t x_group_rows, int64_t x_group_stride, const T* residual,
              int64_t residual_stride, T* residual_out, const T* weight, T* out, int64_t rows, int32_t hidden,
              float eps, bool unit_offset, int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * hidden >= 65536) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const T* xr = x + (r / x_group_rows) * x_group_stride + (r % x_group_rows) * x_stride;
        T* dst = out + r * hidden;
        float sum_sq = 0.0f;
        if (residual != nullptr) {
            const T* rr = residual + r * residual_stride;
            T* ro = residual_out + r * hidden;
            for (int32_t i = 0; i < hidden; ++i) store(ro, i, load(xr, i) + load(rr, i));
            xr = ro;
        }
#pragma omp simd reduction(+ : sum_sq)
        for (int32_t i = 0; i < hidden; ++i) sum_sq += load(xr, i) * load(xr, i);
        const float inv = 1.0f / std::sqrt(sum_sq / static_cast<float>(hidden) + eps);
        if (unit_offset) {
            for (int32_t i = 0; i < hidden; ++i) store(dst, i, load(xr, i) * inv * (1.0f + load(weight, i)));
        } else {
            // the normed value rounded to the dtype before the weight multiply, as HF does
            for (int32_t i = 0; i < hidden; ++i) store(dst, i, load(weight, i) * rounded<T>(load(xr, i) * inv));
        }
    }
}

// NeoX rotary (HF's rotate_half) on rows of x: out = x * cos + (x2 | x1) * sin, with rotate_half's sign in
// sin's first half, each product and the sum rounded to the angles' dtype C as torch's three ops do (no fused
// multiply-add: the same bits as the torch path), the result to x's dtype T. C = T: the decoder's rotary in the
// model's dtype; C = float with bfloat16 x: the vision towers' (x taken to float32, rotated, rounded back once).
// x's rows: `heads` per token, x_stride apart; tokens x_token_stride apart; cos/sin [T, D] contiguous;
// out [T, heads, D] contiguous.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T, typename C>
void rotary(const T* x, int64_t x_stride, int64_t x_token_stride, const C* cos, const C* sin, T* out,
            int64_t tokens, int32_t heads, int32_t head_dim, int32_t num_threads) {
    const int32_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (tokens * heads * head_dim >= 65536) schedule(static)
    for (int64_t t = 0; t < tokens; ++t) {
        const C* c = cos + t * head_dim;
        const C* s = sin + t * head_dim;
        for (int32_t h = 0; h < heads; ++h) {
            const T* xr = x + t * x_token_stride + h * x_stride;
            T* dst = out + (t * heads + h) * head_dim;
            // the two halves apart (rotate_half pairs d with d + half): each loop's reads are contiguous
#pragma omp simd
            for (int32_t d = 0; d < half; ++d) {
                const float turned = rounded<C>(load(xr, d) * load(c, d));
                const float paired = rounded<C>(load(xr, d + half) * load(s, d));
                store(dst, d, turned + paired);  // (the one rounding to T: the store)
            }
#pragma omp simd
            for (int32_t d = half; d < head_dim; ++d) {
                const float turned = rounded<C>(load(xr, d) * load(c, d));
                const float paired = rounded<C>(load(xr, d - half) * load(s, d));
                store(dst, d, turned + paired);  // (the one rounding to T: the store)
            }
        }
    }
}
#pragma GCC pop_options

// out [rows, width] = silu(gate) * up for gate_up [rows, 2 * width] (gate | up); silu(g) = g / (1 + exp(-g)),
// rounded to the dtype before the multiply, as torch's two ops are.
template <typename T>
void silu_and_mul(const T* gate_up, int64_t stride, T* out, int64_t rows, int32_t width, int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * width >= 65536) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const T* gate = gate_up + r * stride;
        const T* up = gate + width;
        T* dst = out + r * width;
#pragma omp simd
        for (int32_t i = 0; i < width; ++i) {
            const float g = load(gate, i);
            store(dst, i, rounded<T>(g / (1.0f + exp_approx(-g))) * load(up, i));
        }
    }
}

// The step's keys and values into the paged cache: row i of k and v ([T, width] elements, row strides
// k_row_stride / v_row_stride; width = Hkv * D, contiguous) to slot slots[i] of k_cache / v_cache ([num_slots,
// width]); a negative slot (a padded row) is skipped. Bytes copied as they are, so any dtype.
void store_kv(const char* k, int64_t k_row_stride, const char* v, int64_t v_row_stride, char* k_cache, char* v_cache,
              const int64_t* slots, int64_t rows, int64_t row_bytes, int64_t element_bytes, int32_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (rows * row_bytes >= 262144) schedule(static)
    for (int64_t i = 0; i < rows; ++i) {
        const int64_t slot = slots[i];
        if (slot < 0) continue;
        std::memcpy(k_cache + slot * row_bytes, k + i * k_row_stride * element_bytes, row_bytes);
        std::memcpy(v_cache + slot * row_bytes, v + i * v_row_stride * element_bytes, row_bytes);
    }
}

}  // namespace

extern "C" {

// dtype: 0 = float32, 1 = bfloat16. sliding_window <= 0: none. softcap <= 0: none. sinks: float32 [num_heads] or
// null (none).
int cbatch_decode_attention(int32_t dtype, const void* q, int64_t q_row_stride, const void* k_cache,
                            const void* v_cache, const int32_t* block_table, int64_t table_stride,
                            const int32_t* seq_lens, const int32_t* query_start, const int32_t* rows,
                            int32_t num_rows, void* out, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim,
                            int32_t block_size, float scale, int32_t sliding_window, float softcap,
                            const float* sinks, int32_t num_threads) {
    if (num_heads % num_kv_heads != 0 || head_dim > 512) return 1;
    if (dtype == 0) {
        decode(static_cast<const float*>(q), q_row_stride, static_cast<const float*>(k_cache),
               static_cast<const float*>(v_cache), block_table, table_stride, seq_lens, query_start, rows, num_rows,
               static_cast<float*>(out), num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window, softcap,
               sinks, num_threads);
        return 0;
    }
    if (dtype == 1) {
        decode(static_cast<const uint16_t*>(q), q_row_stride, static_cast<const uint16_t*>(k_cache),
               static_cast<const uint16_t*>(v_cache), block_table, table_stride, seq_lens, query_start, rows,
               num_rows, static_cast<uint16_t*>(out), num_heads, num_kv_heads, head_dim, block_size, scale,
               sliding_window, softcap, sinks, num_threads);
        return 0;
    }
    return 2;
}

// starts/lens/cached/table_rows int32 [num_chunks]. k/v_cache and block_table may be null when no chunk has
// cached context. key_ends: int32 [T] or null (causal); each chunk row's end must lie past its own position and
// within its chunk (3 otherwise). sliding_window <= 0: none; softcap <= 0: none; sinks: float32 [num_heads] or
// null. Returns 2 for an unknown dtype.
int cbatch_prefill_attention(int32_t dtype, const void* q, int64_t q_row_stride, const void* k, int64_t k_row_stride,
                             const void* v, int64_t v_row_stride, const void* k_cache, const void* v_cache,
                             const int32_t* block_table, int64_t table_stride, int32_t block_size, void* out,
                             const int32_t* starts, const int32_t* lens, const int32_t* cached,
                             const int32_t* table_rows, const int32_t* key_ends, int32_t num_chunks, int32_t num_heads,
                             int32_t num_kv_heads, int32_t head_dim, float scale, int32_t sliding_window,
                             float softcap, const float* sinks, int32_t num_threads) {
    if (num_heads % num_kv_heads != 0 || block_size < 1) return 1;
    for (int32_t p = 0; key_ends != nullptr && p < num_chunks; ++p)  // keys past a chunk's end would be read
        for (int32_t t = 0; t < lens[p]; ++t)
            if (key_ends[starts[p] + t] <= cached[p] + t || key_ends[starts[p] + t] > cached[p] + lens[p]) return 3;
    if (dtype == 0) {
        prefill(static_cast<const float*>(q), q_row_stride, static_cast<const float*>(k), k_row_stride,
                static_cast<const float*>(v), v_row_stride, static_cast<const float*>(k_cache),
                static_cast<const float*>(v_cache), block_table, table_stride, block_size, static_cast<float*>(out),
                starts, lens, cached, table_rows, key_ends, num_chunks, num_heads, num_kv_heads, head_dim, scale,
                sliding_window, softcap, sinks, num_threads);
        return 0;
    }
    if (dtype == 1) {
        prefill(static_cast<const uint16_t*>(q), q_row_stride, static_cast<const uint16_t*>(k), k_row_stride,
                static_cast<const uint16_t*>(v), v_row_stride, static_cast<const uint16_t*>(k_cache),
                static_cast<const uint16_t*>(v_cache), block_table, table_stride, block_size,
                static_cast<uint16_t*>(out), starts, lens, cached, table_rows, key_ends, num_chunks, num_heads,
                num_kv_heads, head_dim, scale, sliding_window, softcap, sinks, num_threads);
        return 0;
    }
    return 2;
}

// residual may be null (no add); residual_out is then unused. Returns 2 for an unknown dtype.
int cbatch_rms_norm(int32_t dtype, const void* x, int64_t x_stride, int64_t x_group_rows, int64_t x_group_stride,
                    const void* residual, int64_t residual_stride, void* residual_out, const void* weight, void* out,
                    int64_t rows, int32_t hidden, float eps, int32_t unit_offset, int32_t num_threads) {
    if (x_group_rows < 1) return 1;
    if (dtype == 0) {
        rms_norm(static_cast<const float*>(x), x_stride, x_group_rows, x_group_stride, static_cast<const float*>(residual), residual_stride,
                 static_cast<float*>(residual_out), static_cast<const float*>(weight), static_cast<float*>(out), rows,
                 hidden, eps, unit_offset != 0, num_threads);
        return 0;
    }
    if (dtype == 1) {
        rms_norm(static_cast<const uint16_t*>(x), x_stride, x_group_rows, x_group_stride, static_cast<const uint16_t*>(residual), residual_stride,
                 static_cast<uint16_t*>(residual_out), static_cast<const uint16_t*>(weight), static_cast<uint16_t*>(out),
                 rows, hidden, eps, unit_offset != 0, num_threads);
        return 0;
    }
    return 2;
}

// dtype: x's and out's, 0 = float32, 1 = bfloat16; angles_dtype: cos's and sin's (float32 angles with bfloat16 x:
// the float32 math of transformers' vision rotary).
int cbatch_rotary(int32_t dtype, const void* x, int64_t x_stride, int64_t x_token_stride, int32_t angles_dtype,
                  const void* cos, const void* sin, void* out, int64_t tokens, int32_t heads, int32_t head_dim,
                  int32_t num_threads) {
    if (head_dim % 2 != 0) return 1;
    if (dtype == 0 && angles_dtype == 0) {
        rotary(static_cast<const float*>(x), x_stride, x_token_stride, static_cast<const float*>(cos),
               static_cast<const float*>(sin), static_cast<float*>(out), tokens, heads, head_dim, num_threads);
        return 0;
    }
    if (dtype == 1 && angles_dtype == 1) {
        rotary(static_cast<const uint16_t*>(x), x_stride, x_token_stride, static_cast<const uint16_t*>(cos),
               static_cast<const uint16_t*>(sin), static_cast<uint16_t*>(out), tokens, heads, head_dim, num_threads);
        return 0;
    }
    if (dtype == 1 && angles_dtype == 0) {
        rotary(static_cast<const uint16_t*>(x), x_stride, x_token_stride, static_cast<const float*>(cos),
               static_cast<const float*>(sin), static_cast<uint16_t*>(out), tokens, heads, head_dim, num_threads);
        return 0;
    }
    return 2;
}

int cbatch_silu_and_mul(int32_t dtype, const void* gate_up, int64_t stride, void* out, int64_t rows, int32_t width,
                        int32_t num_threads) {
    if (dtype == 0) {
        silu_and_mul(static_cast<const float*>(gate_up), stride, static_cast<float*>(out), rows, width, num_threads);
        return 0;
    }
    if (dtype == 1) {
        silu_and_mul(static_cast<const uint16_t*>(gate_up), stride, static_cast<uint16_t*>(out), rows, width,
                     num_threads);
        return 0;
    }
    return 2;
}

// element_bytes: 4 (float32) or 2 (bfloat16); row strides in elements.
int cbatch_store_kv(int64_t element_bytes, const void* k, int64_t k_row_stride, const void* v, int64_t v_row_stride,
                    void* k_cache, void* v_cache, const int64_t* slots, int64_t rows, int64_t width, int32_t num_threads) {
    if (element_bytes != 4 && element_bytes != 2) return 2;
    store_kv(static_cast<const char*>(k), k_row_stride, static_cast<const char*>(v), v_row_stride,
             static_cast<char*>(k_cache), static_cast<char*>(v_cache), slots, rows, width * element_bytes,
             element_bytes, num_threads);
    return 0;
}

}  // extern "C"
