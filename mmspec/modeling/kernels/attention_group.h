/* The attention kernel's body (attention.c), written once over a 16-lane vector kit and included once
 * per kit: VT, the vector type, and OP(name) -> the kit's operation `name` (load, zero, splat, add, mul,
 * fma, fmas, muls, subs, divs, lane_sums, lane_sum, exp, max_into, store, get), ENTRY(name) -> the entry
 * point's name for this kit. Every kit computes the same value in each lane by the same operations, so
 * the kits give bitwise the same outputs; they differ only in how a vector sits in registers (one
 * AVX-512 register, or two AVX2 ones: GCC keeps a 64-byte vector in memory where the CPU has no such
 * register, ~10x slower). No include guard: included once per kit. */

/* The rows of one batch entry b and one key-value head g: the `group` query heads that share it
 * times the n queries, R rows (r = head_in_group * n + i). Keys and values are converted 16 at a
 * time and used by every row that may see them, in increasing key order, so each row's arithmetic
 * is the one-row arithmetic of the module comment. A row that sees a whole block of 16 keys (a
 * chain's cached keys, a tree node's prefix) stores its 16 scores at once; the others place them
 * one by one. Values: each row adds e_j v_j for j up to the last key it sees (exact zeros for the
 * keys it does not see in between), its accumulator held in registers over a block.
 * Scratch: scores [R, L + 16], top / total [R], count / prefix / last [R], q / acc / top [R, .] vectors. */
static inline __attribute__((always_inline)) void ENTRY(attend_group)(
    const void *q, const void *k, const void *v, const uint8_t *mask, void *out, int64_t b, int64_t g, int64_t group,
    int64_t H, int64_t n, int64_t L, int64_t d, int64_t qs_b, int64_t qs_h, int64_t qs_n, int64_t ks_b, int64_t ks_h,
    int64_t ks_l, int64_t ms_b, int64_t ms_n, float scale, int bf16, float *scores, float *top, float *total,
    int64_t *count, int64_t *prefix, int64_t *last_key, VT *qv, VT *acc, VT *topv) {
    const int64_t R = group * n, chunks = (d + 15) / 16, stride = L + 16, width = bf16 ? 2 : 4;
    const char *kb = (const char *)k + (b * ks_b + g * ks_h) * width, *vb = (const char *)v + (b * ks_b + g * ks_h) * width;
    for (int64_t r = 0; r < R; r++) {
        const int64_t h = g * group + r / n, i = r % n;
        const char *qr = (const char *)q + (b * qs_b + h * qs_h + i * qs_n) * width;
        for (int64_t t = 0; t < chunks; t++) qv[r * chunks + t] = OP(load)(qr, t * 16, d - t * 16, bf16);
        top[r] = -3.0e38f, count[r] = 0, prefix[r] = 0, last_key[r] = -1;
        topv[r] = OP(splat)(-3.0e38f);
    }
    const uint8_t *mrow = mask ? mask + b * ms_b : NULL;
    VT block[16 * 16]; /* d <= 256; 16 keys' (then values') chunks */
    for (int64_t j0 = 0; j0 < L; j0 += 16) { /* scores of 16 keys at a time, compact per row */
        const int64_t keys = L - j0 < 16 ? L - j0 : 16;
        for (int64_t slot = 0; slot < 16; slot++)
            for (int64_t t = 0; t < chunks; t++)
                block[slot * chunks + t] = PERM[slot] < keys
                    ? OP(load)(kb + (j0 + PERM[slot]) * ks_l * width, t * 16, d - t * 16, bf16) : OP(zero)();
        for (int64_t r = 0; r < R; r++) {
            const int64_t i = r % n, last = mrow ? L : L - n + i; /* chain: keys beyond `last` are masked */
            const uint8_t *seen = mrow ? mrow + i * ms_n : NULL;
            int whole;
            if (seen) {
                whole = mask_block(seen + j0, keys);
                if (whole < 0) continue;
            } else {
                if (j0 > last) continue;
                whole = keys == 16 && j0 + 15 <= last;
            }
            const VT *qr = qv + r * chunks;
            VT dots[16];
            for (int64_t slot = 0; slot < 16; slot++) {
                const VT *kr = block + slot * chunks;
                VT s = OP(mul)(qr[0], kr[0]);
                for (int64_t t = 1; t < chunks; t++) s = OP(fma)(s, qr[t], kr[t]);
                dots[slot] = s;
            }
            const VT sums = OP(muls)(OP(lane_sums)(dots), scale);
            float *row = scores + r * stride;
            int64_t c = count[r];
            if (whole > 0) {
                OP(store)(row + c, sums);
                topv[r] = OP(max_into)(topv[r], sums);
                if (c == j0) prefix[r] = j0 + 16; /* compact index = key index so far */
                count[r] = c + 16, last_key[r] = j0 + 15;
                continue;
            }
            float best = top[r];
            for (int64_t jj = 0; jj < keys; jj++) {
                const int64_t j = j0 + jj;
                if (seen ? !seen[j] : j > last) continue;
                const float score = OP(get)(sums, jj);
                row[c++] = score;
                best = score > best ? score : best;
                last_key[r] = j;
            }
            count[r] = c, top[r] = best;
        }
    }
    for (int64_t r = 0; r < R; r++) { /* e = exp(score - top), summed in 16 lanes by compact index */
        float *row = scores + r * stride, best = top[r];
        for (int l = 0; l < 16; l++) best = OP(get)(topv[r], l) > best ? OP(get)(topv[r], l) : best;
        const int64_t m = count[r], padded = (m + 15) & ~(int64_t)15, i = r % n;
        for (int64_t c = m; c < padded; c++) row[c] = -1.0e30f;
        VT sum = OP(zero)();
        for (int64_t c = 0; c < padded; c += 16) {
            const VT e = OP(exp)(OP(subs)(OP(load)(row + c, 0, 16, 0), best));
            sum = OP(add)(sum, e);
            OP(store)(row + c, e);
        }
        total[r] = OP(lane_sum)(sum);
        if (mrow) /* back to key order in place after the prefix (compact index <= key index): 0 where unseen */
            for (int64_t j = last_key[r], c = m - 1; j >= prefix[r]; j--)
                row[j] = mrow[i * ms_n + j] ? row[c--] : 0.0f;
        for (int64_t t = 0; t < chunks; t++) acc[r * chunks + t] = OP(zero)();
    }
    for (int64_t j0 = 0; j0 < L; j0 += 16) { /* sum_j e_j v_j in key order, 16 values at a time */
        const int64_t keys = L - j0 < 16 ? L - j0 : 16;
        int64_t needed = 0; /* values of the block some row sees */
        for (int64_t r = 0; r < R; r++) {
            const int64_t end = last_key[r] - j0 + 1;
            needed = end > needed ? end : needed;
        }
        if (needed <= 0) continue;
        needed = needed < keys ? needed : keys;
        for (int64_t jj = 0; jj < needed; jj++)
            for (int64_t t = 0; t < chunks; t++)
                block[jj * chunks + t] = OP(load)(vb + (j0 + jj) * ks_l * width, t * 16, d - t * 16, bf16);
        for (int64_t r = 0; r < R; r++) {
            const int64_t end = last_key[r] - j0 + 1 < needed ? last_key[r] - j0 + 1 : needed;
            if (end <= 0) continue;
            const float *e = scores + r * stride + j0;
            VT a[16];
            for (int64_t t = 0; t < chunks; t++) a[t] = acc[r * chunks + t];
            for (int64_t jj = 0; jj < end; jj++)
                for (int64_t t = 0; t < chunks; t++) a[t] = OP(fmas)(a[t], e[jj], block[jj * chunks + t]);
            for (int64_t t = 0; t < chunks; t++) acc[r * chunks + t] = a[t];
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const int64_t h = g * group + r / n, i = r % n;
        char *o = (char *)out + (((b * n + i) * H + h) * d) * width;
        for (int64_t t = 0; t < chunks; t++) {
            float value[16];
            OP(store)(value, count[r] ? OP(divs)(acc[r * chunks + t], total[r]) : OP(zero)()); /* no key: zeros (SDPA: NaN) */
            const int64_t lanes = d - t * 16 < 16 ? d - t * 16 : 16;
            if (bf16)
                for (int64_t l = 0; l < lanes; l++) ((uint16_t *)o)[t * 16 + l] = float_to_bf16(value[l]);
            else
                for (int64_t l = 0; l < lanes; l++) ((float *)o)[t * 16 + l] = value[l];
        }
    }
}

/* q [B, H, n, d], k / v [B, Hkv, L, d] (element strides given; the last dimension contiguous),
 * mask [B or 1, n, L] bytes (1: attend; stride ms_b = 0 broadcasts) or NULL: query i sees keys
 * j <= L - n + i (a chain after the cache); out [B, n, H, d] contiguous. fp32 or bf16 (`bf16`).
 * One thread: the rows are few. Returns 0, -1 where d > 256 or the scratch cannot be allocated. */
static inline __attribute__((always_inline)) int ENTRY(attention_body)(
    const void *q, const void *k, const void *v, const uint8_t *mask, void *out, int64_t B, int64_t H, int64_t Hkv,
    int64_t n, int64_t L, int64_t d, int64_t qs_b, int64_t qs_h, int64_t qs_n, int64_t ks_b, int64_t ks_h, int64_t ks_l,
    int64_t ms_b, int64_t ms_n, float scale, int bf16) {
    if (d > 256 || d < 1 || Hkv < 1 || H % Hkv) return -1;
    const int64_t group = H / Hkv, R = group * n, chunks = (d + 15) / 16;
    float *scores = malloc((size_t)(R * (L + 16) + 2 * R) * sizeof(float));
    int64_t *count = malloc((size_t)(3 * R) * sizeof(int64_t));
    VT *vectors = aligned_alloc(64, (size_t)(2 * R * chunks + R) * sizeof(VT));
    if (!scores || !count || !vectors) {
        free(scores), free(count), free(vectors);
        return -1;
    }
    /* the common head sizes compiled with d constant (unrolled, the key in registers); the same arithmetic */
#define GROUPS(D, BF16)                                                                                                \
    for (int64_t b = 0; b < B; b++)                                                                                    \
        for (int64_t g = 0; g < Hkv; g++)                                                                              \
            ENTRY(attend_group)(q, k, v, mask, out, b, g, group, H, n, L, D, qs_b, qs_h, qs_n, ks_b, ks_h, ks_l, ms_b, \
                                ms_n, scale, BF16, scores, scores + R * (L + 16), scores + R * (L + 16) + R, count,      \
                                count + R, count + 2 * R, vectors, vectors + R * chunks, vectors + 2 * R * chunks)
    if (d == 64 && bf16) GROUPS(64, 1);
    else if (d == 64) GROUPS(64, 0);
    else if (d == 128 && bf16) GROUPS(128, 1);
    else if (d == 128) GROUPS(128, 0);
    else GROUPS(d, bf16);
#undef GROUPS
    free(scores), free(count), free(vectors);
    return 0;
}
