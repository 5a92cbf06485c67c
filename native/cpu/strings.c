/* strings.c: gt_scan_strings, the bounds-checked walk over a run of
 * length-prefixed strings (GGUF's string arrays: u64 little-endian length, then
 * that many UTF-8 bytes). Python would need a loop per string; this is one call. */
#include "internal.h"

/* Length of the valid UTF-8 sequence starting at s[0] (at most `left` bytes),
 * or 0 if it is invalid: overlong forms, surrogates and code points above
 * U+10FFFF are rejected, as Python's strict decoder does. */
static int utf8_seq(const uint8_t *s, int64_t left) {
    const uint8_t c = s[0];
    if (c < 0x80) return 1;
    int len;
    uint8_t lo = 0x80, hi = 0xbf;   /* allowed range of the second byte */
    if (c >= 0xc2 && c <= 0xdf) len = 2;
    else if (c == 0xe0) { len = 3; lo = 0xa0; }
    else if (c >= 0xe1 && c <= 0xef) { len = 3; if (c == 0xed) hi = 0x9f; }
    else if (c == 0xf0) { len = 4; lo = 0x90; }
    else if (c >= 0xf1 && c <= 0xf3) len = 4;
    else if (c == 0xf4) { len = 4; hi = 0x8f; }
    else return 0;
    if (left < len) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    for (int k = 2; k < len; k++)
        if (s[k] < 0x80 || s[k] > 0xbf) return 0;
    return len;
}

int gt_scan_strings(int64_t *bounds, const uint8_t *data, int64_t size, int64_t n, int64_t *end) {
    if (!end || n < 0 || size < 0 || (n > 0 && !data))
        return GT_FAIL(GT_ERR_INVALID, "scan_strings: bad arguments");
    int64_t pos = 0;
    for (int64_t i = 0; i < n; i++) {
        if (size - pos < 8) {
            *end = i;
            return GT_FAIL(GT_ERR_INVALID, "string %lld: its length at byte +%lld runs past the end",
                           (long long)i, (long long)pos);
        }
        uint64_t len = 0;
        for (int k = 7; k >= 0; k--) len = (len << 8) | data[pos + k];
        pos += 8;
        if (len > (uint64_t)(size - pos)) {
            *end = i;
            return GT_FAIL(GT_ERR_INVALID, "string %lld: length %llu at byte +%lld runs past the end",
                           (long long)i, (unsigned long long)len, (long long)(pos - 8));
        }
        const int64_t stop = pos + (int64_t)len;
        for (int64_t p = pos; p < stop;) {
            if (data[p] < 0x80) { p++; continue; }
            const int k = utf8_seq(data + p, stop - p);
            if (!k) {
                *end = i;
                return GT_FAIL(GT_ERR_INVALID, "string %lld: invalid UTF-8 at byte +%lld",
                               (long long)i, (long long)p);
            }
            p += k;
        }
        if (bounds) {
            bounds[2 * i] = pos;
            bounds[2 * i + 1] = stop;
        }
        pos = stop;
    }
    *end = pos;
    return GT_OK;
}
