//! Prompt lookup inside one context: where the context's end occurred before in the context
//! itself, and how deep that earlier occurrence matches. The conversation's own repeats (a
//! revision of an answer, an edit of code the prompt holds) are the most specific evidence a
//! suffix-match draft has; this is the context half of that draft, the window's
//! [`crate::Window::suffix_lookup`] the other.

/// The latest earlier occurrence of the context's longest suffix of `max_match` down to
/// `min_match` tokens (at least 1) inside the context, as `(depth, start)`: the tokens from
/// `start` on followed it (`start < ctx.len()`), and `depth` counts how many tokens before
/// `start` equal the context's last ones (at least the suffix's length; beyond it counted up to
/// `measure` and `start`). None when no such suffix recurs.
pub fn context_match(ctx: &[i64], min_match: usize, max_match: usize, measure: usize) -> Option<(usize, usize)> {
    let n_ctx = ctx.len();
    let lo = min_match.max(1);
    let hi = max_match.min(n_ctx.saturating_sub(1));
    for n in (lo..=hi).rev() {
        let pattern = &ctx[n_ctx - n..];
        // starts i < n_ctx - n, the latest first (the suffix itself excluded)
        if let Some(i) = (0..n_ctx - n).rev().find(|&i| &ctx[i..i + n] == pattern) {
            let start = i + n;
            let deep = measure.min(start).max(n);
            let mut m = n;
            while m < deep && ctx[start - 1 - m] == ctx[n_ctx - 1 - m] {
                m += 1;
            }
            return Some((m, start));
        }
    }
    None
}
