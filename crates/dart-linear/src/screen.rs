//! An LM head's products made again where a drafter's search reads them: after a product over
//! cheap weights (Q4_0 blocks) has given every output of a row, the row's `m` largest outputs
//! are recomputed from the float weight. A drafter's tree search reads only the top of each
//! row (its top-k tokens and their log-probabilities within the top-k), so those come out as
//! the float weight's while the head streams the blocks' bytes, and the recomputation reads
//! only `m` weight rows per row (a few hundred KB at most, against megabytes for the head).

use crate::ops::dot;
use crate::ShapeError;

/// The `m` largest of `values` (ties: the lower index first), in no particular order, into
/// `out` (cleared first): a min-heap of `m` entries over one pass, the pass comparing sixteen
/// values at a time with the heap's smallest (a vectorisable test) and looking closer only at
/// the few blocks that hold a larger one.
fn top_indices(values: &[f32], m: usize, out: &mut Vec<usize>) {
    out.clear();
    let m = m.min(values.len());
    if m == 0 {
        return;
    }
    // heap[0] is the smallest kept entry: (value, index) ordered by value, then by index
    // reversed (of two equal values the higher index is the smaller entry).
    let less = |a: (f32, usize), b: (f32, usize)| match a.0.total_cmp(&b.0) {
        std::cmp::Ordering::Equal => a.1 > b.1,
        o => o.is_lt(),
    };
    let sift_down = |heap: &mut [(f32, usize)], mut i: usize| loop {
        let (l, r) = (2 * i + 1, 2 * i + 2);
        let mut s = i;
        if l < heap.len() && less(heap[l], heap[s]) {
            s = l;
        }
        if r < heap.len() && less(heap[r], heap[s]) {
            s = r;
        }
        if s == i {
            break;
        }
        heap.swap(i, s);
        i = s;
    };
    let mut heap: Vec<(f32, usize)> = values[..m].iter().copied().zip(0..m).collect();
    for i in (0..m / 2).rev() {
        sift_down(&mut heap, i);
    }
    // A later value enters only when strictly larger than the smallest kept one (an equal one
    // has the higher index); NaN is never larger.
    let push = |heap: &mut Vec<(f32, usize)>, v: f32, j: usize| {
        if v > heap[0].0 {
            heap[0] = (v, j);
            sift_down(heap, 0);
        }
    };
    let rest = &values[m..];
    let (blocks, tail) = rest.as_chunks::<16>();
    for (b, block) in blocks.iter().enumerate() {
        let t = heap[0].0;
        let mut any = false;
        for &v in block {
            any |= v > t;
        }
        if any {
            for (l, &v) in block.iter().enumerate() {
                push(&mut heap, v, m + 16 * b + l);
            }
        }
    }
    for (l, &v) in tail.iter().enumerate() {
        push(&mut heap, v, m + 16 * blocks.len() + l);
    }
    out.extend(heap.iter().map(|&(_, j)| j));
}

/// For each of the `rows` rows of `values` (`[rows, n]`: the products of `x` `[rows, k]` with
/// an approximation of `w`), its `m` largest values (ties: the lower index first) made again as
/// `x[r] · w[j] (+ bias[j])` from the float weight `w` (`[n, k]`, row-major), in place. The
/// dot products are float32 sums in a fixed order: a row's results do not depend on the other
/// rows. A NaN value is never made again unless fewer than `m` values are numbers.
#[allow(clippy::too_many_arguments)]
pub fn refine_top(
    values: &mut [f32],
    rows: usize,
    n: usize,
    m: usize,
    x: &[f32],
    k: usize,
    w: &[f32],
    bias: Option<&[f32]>,
) -> Result<(), ShapeError> {
    if Some(values.len()) != rows.checked_mul(n)
        || Some(x.len()) != rows.checked_mul(k)
        || Some(w.len()) != n.checked_mul(k)
        || bias.is_some_and(|b| b.len() != n)
    {
        return Err(ShapeError(format!(
            "refine_top: values {} / x {} / w {} / bias {:?} elements do not fit {rows} rows of {n} \
             outputs over {k} inputs",
            values.len(),
            x.len(),
            w.len(),
            bias.map(<[f32]>::len)
        )));
    }
    if k == 0 {
        return Err(ShapeError("refine_top: k must be positive".into()));
    }
    let m = m.min(n);
    let mut best = Vec::with_capacity(m);
    for r in 0..rows {
        let row = &mut values[r * n..(r + 1) * n];
        top_indices(row, m, &mut best);
        let xr = &x[r * k..(r + 1) * k];
        // every gathered row on its way at once (random rows: each would otherwise wait a
        // memory latency per few lines)
        #[cfg(target_arch = "x86_64")]
        for &j in &best {
            for line in w[j * k..(j + 1) * k].chunks(16) {
                // SAFETY: a prefetch of an address inside `w` (never faults, reads nothing).
                unsafe { std::arch::x86_64::_mm_prefetch(line.as_ptr().cast::<i8>(), std::arch::x86_64::_MM_HINT_T1) };
            }
        }
        for &j in &best {
            row[j] = dot(xr, &w[j * k..(j + 1) * k]) + bias.map_or(0.0, |b| b[j]);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::data;

    #[test]
    fn each_rows_largest_values_are_made_again_from_the_float_weight() {
        let (rows, n, k, m) = (3, 500, 40, 25);
        let w = data(n * k, 11);
        let x = data(rows * k, 12);
        let bias = data(n, 13);
        let exact: Vec<f32> = (0..rows * n)
            .map(|i| dot(&x[i / n * k..(i / n + 1) * k], &w[i % n * k..(i % n + 1) * k]) + bias[i % n])
            .collect();
        // a rough approximation of the products, with ties among the large ones
        let mut values: Vec<f32> = exact.iter().map(|v| (v * 4.0).round() / 4.0).collect();
        let rough = values.clone();
        refine_top(&mut values, rows, n, m, &x, k, &w, Some(&bias)).unwrap();
        for r in 0..rows {
            let mut order: Vec<usize> = (0..n).collect();
            // by the rough value, descending, the lower index first among equals
            order.sort_by(|&a, &b| rough[r * n + b].total_cmp(&rough[r * n + a]).then(a.cmp(&b)));
            for (rank, &j) in order.iter().enumerate() {
                let (got, want) = (values[r * n + j], if rank < m { exact[r * n + j] } else { rough[r * n + j] });
                assert_eq!(got.to_bits(), want.to_bits(), "row {r}, output {j}, rank {rank}");
            }
        }
        // a row's results are the same alone
        let mut alone = rough[n..2 * n].to_vec();
        refine_top(&mut alone, 1, n, m, &x[k..2 * k], k, &w, Some(&bias)).unwrap();
        assert_eq!(alone, values[n..2 * n]);
    }

    #[test]
    fn more_than_every_output_or_none_and_bad_shapes() {
        let (n, k) = (7, 16);
        let w = data(n * k, 1);
        let x = data(k, 2);
        let mut all = vec![0f32; n];
        refine_top(&mut all, 1, n, 100, &x, k, &w, None).unwrap();
        for (j, v) in all.iter().enumerate() {
            assert_eq!(*v, dot(&x, &w[j * k..(j + 1) * k]));
        }
        let mut none = vec![0.5f32; n];
        refine_top(&mut none, 1, n, 0, &x, k, &w, None).unwrap();
        assert!(none.iter().all(|&v| v == 0.5));
        assert!(refine_top(&mut vec![0f32; n], 1, n, 3, &x[1..], k, &w, None).is_err());
        assert!(refine_top(&mut vec![0f32; n], 1, n, 3, &x, k, &w, Some(&[0.0])).is_err());
    }
}
