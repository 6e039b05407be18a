//! The drafter rows' top-k with their log-probabilities renormalised inside the top-k: the one
//! place Eq. (10)'s p_l is formed from drafter logits (`dartcore.tree.topk_logprobs`).
//!
//! Per row: a lower bound of the k-th best logit from the maxima of 16-logit chunks, then the
//! few logits that reach it, sorted (four drafter rows of 8 192 logits with k = 25: ~25 µs;
//! the framework's top-k took ~90 µs on one thread of the dev box).
use crate::error::{Error, Result};

/// Top-`k` of every row of `logits` (`[rows, v]`, row-major) and the log-softmax over those k
/// values: `(ids, logprobs)`, each `[rows, k]`, every row in descending order of its logits
/// (equal logits: the lower id first). The log-softmax is computed in f64 and rounded once.
/// A row whose k best are all −inf gets −inf log-probabilities (no possible token). NaN or
/// +inf logits are errors.
pub fn topk_logprobs(logits: &[f32], rows: usize, k: usize) -> Result<(Vec<u32>, Vec<f32>)> {
    if rows == 0 || !logits.len().is_multiple_of(rows) {
        return Err(Error::shape(format!("{} logits do not split into {rows} rows", logits.len())));
    }
    let v = logits.len() / rows;
    if k == 0 || k > v {
        return Err(Error::shape(format!("k = {k} must be in 1..={v} (the vocabulary of the logits)")));
    }
    if v > u32::MAX as usize {
        return Err(Error::shape(format!("a vocabulary of {v} ids does not fit in u32")));
    }
    let mut ids = Vec::with_capacity(rows * k);
    let mut lps = Vec::with_capacity(rows * k);
    let mut maxima: Vec<f32> = Vec::with_capacity(v.div_ceil(16));
    let mut best: Vec<(f32, u32)> = Vec::new();
    for (r, row) in logits.chunks_exact(v).enumerate() {
        // NaN and +inf are errors (one pass to check, another to find the first).
        if row
            .chunks(16)
            .fold(false, |bad, c| bad | c.iter().fold(false, |b, &x| b | x.is_nan() | (x == f32::INFINITY)))
        {
            let (col, &value) =
                row.iter().enumerate().find(|(_, x)| x.is_nan() || **x == f32::INFINITY).expect("found above");
            return Err(Error::BadLogprob { what: "logits", row: r, col, value });
        }
        // A threshold no higher than the k-th best logit: the k-th largest of the maxima of
        // 16-logit chunks (k of those maxima are k distinct logits). Usually only a little
        // over k logits reach it.
        maxima.clear();
        maxima.extend(row.chunks(16).map(|c| c.iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m })));
        let threshold = if maxima.len() > k {
            *maxima.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a)).1
        } else {
            f32::NEG_INFINITY
        };
        best.clear();
        for (c, chunk) in row.chunks(16).enumerate() {
            if chunk.iter().fold(false, |any, &x| any | (x >= threshold)) {
                best.extend(
                    chunk.iter().enumerate().filter(|(_, x)| **x >= threshold).map(|(j, &x)| (x, (c * 16 + j) as u32)),
                );
            }
        }
        // descending logits; equal logits: the lower id first
        best.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        best.truncate(k);
        let top = best[0].0;
        if top == f32::NEG_INFINITY {
            ids.extend(best.iter().map(|&(_, i)| i));
            lps.extend(std::iter::repeat_n(f32::NEG_INFINITY, k));
            continue;
        }
        let sum: f64 = best.iter().map(|&(x, _)| ((x - top) as f64).exp()).sum();
        let log_sum = sum.ln();
        for &(x, i) in &best {
            ids.push(i);
            lps.push((((x - top) as f64) - log_sum) as f32);
        }
    }
    Ok((ids, lps))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_sort_and_a_float64_log_softmax() {
        let (rows, v, k) = (3, 200, 7);
        let mut state = 12345u64;
        let logits: Vec<f32> = (0..rows * v)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 12.0
            })
            .collect();
        let (ids, lps) = topk_logprobs(&logits, rows, k).unwrap();
        for r in 0..rows {
            let row = &logits[r * v..(r + 1) * v];
            let mut order: Vec<usize> = (0..v).collect();
            order.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
            let want: Vec<u32> = order[..k].iter().map(|&i| i as u32).collect();
            assert_eq!(&ids[r * k..(r + 1) * k], &want[..]);
            let top: Vec<f64> = order[..k].iter().map(|&i| row[i] as f64).collect();
            let z = top.iter().map(|x| (x - top[0]).exp()).sum::<f64>().ln();
            for j in 0..k {
                assert!((lps[r * k + j] as f64 - (top[j] - top[0] - z)).abs() < 1e-6);
            }
        }
    }

    #[test]
    fn ties_keep_the_lower_id_first_and_impossible_rows_stay_impossible() {
        let logits = [1.0, 3.0, 3.0, 0.5, f32::NEG_INFINITY, f32::NEG_INFINITY, f32::NEG_INFINITY, f32::NEG_INFINITY];
        let (ids, lps) = topk_logprobs(&logits, 2, 2).unwrap();
        assert_eq!(ids, vec![1, 2, 0, 1]);
        assert!((lps[0] - (0.5f32).ln()).abs() < 1e-7 && lps[0] == lps[1]);
        assert!(lps[2..].iter().all(|&x| x == f32::NEG_INFINITY));
    }

    #[test]
    fn bad_input_is_an_error() {
        assert!(topk_logprobs(&[1.0, 2.0, 3.0], 2, 1).is_err());
        assert!(topk_logprobs(&[1.0, 2.0], 1, 3).is_err());
        assert!(topk_logprobs(&[1.0, 2.0], 1, 0).is_err());
        let err = topk_logprobs(&[1.0, f32::NAN, 2.0, 0.0], 1, 2).unwrap_err();
        assert!(err.to_string().contains("NaN"), "{err}");
        assert!(topk_logprobs(&[1.0, 2.0, f32::INFINITY], 1, 1).is_err());
    }
}
