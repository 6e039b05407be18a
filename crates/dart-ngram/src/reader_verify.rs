//! The checks of the body that `open` does not make: `verify` (`Verify::Full`), O(file
//! size), and `quick` (`Verify::Quick`), which checks the small sections fully and samples
//! the large ones.

use crate::error::{Error, Result};
use crate::format::{
    get32, get64, Sec, BLOCK, BLOCK3_LEN, QUICK_CRC_BYTES, QUICK_SAMPLES, QUICK_WINDOW, SECTIONS, TOPK_K, UNI_LEN,
};
use crate::reader::Index;

fn bad(msg: impl Into<String>) -> Error {
    Error::format(format!("verify: {}", msg.into()))
}

/// Expected top-k relative positions of decoded children (count desc, token asc).
fn top_positions(kids: &[(u32, u64)], k: usize, scratch: &mut Vec<(u64, u32, u32)>) -> Vec<u32> {
    scratch.clear();
    scratch.extend(kids.iter().enumerate().map(|(i, &(t, c))| (c, t, i as u32)));
    scratch.sort_unstable_by(|x, y| y.0.cmp(&x.0).then(x.1.cmp(&y.1)));
    scratch.iter().take(k).map(|x| x.2).collect()
}

fn check_crc<D: AsRef<[u8]>>(ix: &Index<D>, i: usize) -> Result<()> {
    if ix.section_crc_ok(i) != Some(true) {
        return Err(bad(format!("checksum mismatch in section {}: the file is corrupt", SECTIONS[i].name())));
    }
    Ok(())
}

pub(crate) fn verify<D: AsRef<[u8]>>(ix: &Index<D>) -> Result<()> {
    for i in 0..SECTIONS.len() {
        check_crc(ix, i)?;
    }
    check_unigrams(ix)?;
    let h = ix.header().clone();
    let v = h.vocab_size;
    let mut kids: Vec<(u32, u64)> = Vec::new();
    let mut scratch = Vec::new();
    let mut large1 = 0usize;
    let mut esc2 = 0u64;
    for a in 0..v {
        let (s, e, total, large) = ix.ctx1_pub(a).ok_or_else(|| bad(format!("bigram range of token {a}")))?;
        check_children(ix, 2, s, e, total, v, &mut kids, &mut esc2, h.esc_code())?;
        check_topk(ix, Sec::TopK1, &kids, large, &mut large1, &mut scratch)?;
    }
    if large1 as u64 != h.n_large1 || esc2 != h.n_esc2 {
        return Err(bad("level-2 large-context or escape counts disagree with the header"));
    }
    // level 3
    let mut large2 = 0usize;
    let mut esc3 = 0u64;
    let mut prev_e = 0usize;
    for j in 0..h.n_bigram as usize {
        let (s, e, total, large) = ix.ctx2_pub(j).ok_or_else(|| bad(format!("trigram range of bigram node {j}")))?;
        if s != prev_e {
            return Err(bad("trigram ranges are not contiguous"));
        }
        prev_e = e;
        check_children(ix, 3, s, e, total, v, &mut kids, &mut esc3, h.esc_code())?;
        check_topk(ix, Sec::TopK2, &kids, large, &mut large2, &mut scratch)?;
    }
    if prev_e as u64 != h.n_trigram || large2 as u64 != h.n_large2 || esc3 != h.n_esc3 {
        return Err(bad("level-3 node, large-context or escape counts disagree with the header"));
    }
    // escape rank tables
    for (lvl, sec, n) in [(2u8, Sec::L2EscRank, h.n_bigram), (3u8, Sec::L3EscRank, h.n_trigram)] {
        let ranks = ix.section(sec);
        let (_, _, esc_code) = ix.level_view(lvl);
        let nodes = ix.section(if lvl == 2 { Sec::L2Nodes } else { Sec::L3Nodes });
        let mut r = 0u64;
        for i in 0..n as usize {
            if i % BLOCK == 0 && get64(ranks, i / BLOCK * 8) != Some(r) {
                return Err(bad(format!("{} is inconsistent", sec.name())));
            }
            r += (get32(nodes, i * 4).unwrap_or(0) & esc_code == esc_code) as u64;
        }
        if get64(ranks, (n as usize).div_ceil(BLOCK) * 8) != Some(r) {
            return Err(bad(format!("{} sentinel is wrong", sec.name())));
        }
    }
    Ok(())
}

/// The O(vocabulary) invariants: unigram counts and order, and the UNI records' bigram ranges.
fn check_unigrams<D: AsRef<[u8]>>(ix: &Index<D>) -> Result<()> {
    let h = ix.header().clone();
    let v = h.vocab_size;
    let mut tokens = 0u64;
    let mut seen = 0u64;
    for t in 0..v {
        let c = ix.uni_count_pub(t);
        tokens = tokens.checked_add(c).ok_or_else(|| bad("unigram counts overflow"))?;
        seen += (c > 0) as u64;
    }
    if tokens != h.tokens || seen != h.n_unigram {
        return Err(bad("unigram counts disagree with the header"));
    }
    let order = ix.section(Sec::UniOrder);
    let mut prev: Option<(u64, u32)> = None;
    for i in 0..h.n_unigram as usize {
        let t = get32(order, i * 4).ok_or_else(|| bad("unigram order"))?;
        let c = ix.uni_count_pub(t);
        if t >= v || c == 0 {
            return Err(bad("unigram order lists an unseen or out-of-range token"));
        }
        if let Some((pc, pt)) = prev {
            if !(c < pc || (c == pc && t > pt)) {
                return Err(bad("unigram order is not by descending count"));
            }
        }
        prev = Some((c, t));
    }
    // level 2 (bigram nodes, children of one-token contexts)
    let mut next = 0u64;
    for a in 0..v {
        let (s, e, _, _) = ix.ctx1_pub(a).ok_or_else(|| bad(format!("bigram range of token {a}")))?;
        if s as u64 != next {
            return Err(bad(format!("UNI record {a}: bigram ranges are not contiguous")));
        }
        next = e as u64;
    }
    if next != h.n_bigram || get64(ix.section(Sec::Uni), v as usize * UNI_LEN) != Some(h.n_bigram) {
        return Err(bad("UNI records do not span the bigram nodes"));
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn check_children<D: AsRef<[u8]>>(
    ix: &Index<D>,
    level: u8,
    s: usize,
    e: usize,
    total: u64,
    v: u32,
    kids: &mut Vec<(u32, u64)>,
    esc: &mut u64,
    esc_code: u32,
) -> Result<()> {
    kids.clear();
    ix.decode_all(level, s, e, |t, c| kids.push((t, c)));
    if kids.len() != e - s {
        return Err(bad("node array shorter than its ranges"));
    }
    let mut sum = 0u64;
    for (i, &(t, c)) in kids.iter().enumerate() {
        if t >= v || c == 0 || (i > 0 && t <= kids[i - 1].0) {
            return Err(bad(format!("level-{level} children not sorted, zero or out of range at node {}", s + i)));
        }
        if c >= esc_code as u64 {
            *esc += 1;
        }
        sum = sum.checked_add(c).ok_or_else(|| bad("count overflow"))?;
    }
    if sum > total {
        return Err(bad(format!("level-{level} context total {total} is below its children's sum {sum}")));
    }
    Ok(())
}

fn check_topk<D: AsRef<[u8]>>(
    ix: &Index<D>,
    sec: Sec,
    kids: &[(u32, u64)],
    large: Option<usize>,
    next_rank: &mut usize,
    scratch: &mut Vec<(u64, u32, u32)>,
) -> Result<()> {
    if let Some(r) = large {
        if r != *next_rank {
            return Err(bad(format!("{}: large-context flags are inconsistent", sec.name())));
        }
        *next_rank += 1;
    }
    check_topk_row(ix, sec, kids, large, scratch)
}

/// A context has a top-K row exactly when it has more than K children, and the row holds
/// its top K (count desc, token asc).
fn check_topk_row<D: AsRef<[u8]>>(
    ix: &Index<D>,
    sec: Sec,
    kids: &[(u32, u64)],
    large: Option<usize>,
    scratch: &mut Vec<(u64, u32, u32)>,
) -> Result<()> {
    match (kids.len() > TOPK_K, large) {
        (false, None) => Ok(()),
        (true, Some(r)) => {
            let want = top_positions(kids, TOPK_K, scratch);
            let mut ch = crate::reader::Children::new();
            ix.topk_row_pub(sec, r, &mut ch)?;
            let got: Vec<(u32, u64)> = ch.tokens().iter().copied().zip(ch.counts().iter().copied()).collect();
            let want: Vec<(u32, u64)> = want.iter().map(|&p| kids[p as usize]).collect();
            if got != want {
                return Err(bad(format!("{} row {r} is not the top-{TOPK_K} of its context", sec.name())));
            }
            Ok(())
        }
        _ => Err(bad(format!("{}: large-context flags are inconsistent", sec.name()))),
    }
}

// ---- Verify::Quick ----------------------------------------------------------------------

/// `samples` positions in `0..n`, one per equal stratum, at a pseudo-random offset
/// inside it (seeded by the file's table CRC: the same file is always sampled alike).
fn strata(n: u64, samples: usize, seed: u32) -> impl Iterator<Item = u64> {
    let s = (samples as u64).min(n);
    let mut x = u64::from(seed) ^ 0x9e37_79b9_7f4a_7c15;
    (0..s).map(move |i| {
        // splitmix64
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let (lo, hi) = (i * n / s, (i + 1) * n / s);
        lo + z % (hi - lo).max(1)
    })
}

/// The last `i` in `0..n` with `key(i) <= p` (`key` ascending on an intact file).
fn last_at_or_below(n: usize, p: u64, key: impl Fn(usize) -> Option<u64>) -> Result<usize> {
    let (mut lo, mut hi) = (0usize, n);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if key(mid).ok_or_else(|| bad("node ranges cannot be read"))? <= p {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}

/// Check the context `s..e` (total `total`, top-K row `large`) of `level` around node `p`:
/// the whole context when it has at most `QUICK_WINDOW` children, else `QUICK_WINDOW` nodes
/// around `p` (sorted, in range, non-zero; the sum and top-K need the whole context); and the
/// escape ranks of the node blocks read.
#[allow(clippy::too_many_arguments)]
fn check_place<D: AsRef<[u8]>>(
    ix: &Index<D>,
    level: u8,
    (s, e, total, large): (usize, usize, u64, Option<usize>),
    p: usize,
    kids: &mut Vec<(u32, u64)>,
    scratch: &mut Vec<(u64, u32, u32)>,
) -> Result<()> {
    let h = ix.header();
    let n = if level == 2 { h.n_bigram } else { h.n_trigram } as usize;
    if !(s <= p && p < e) {
        return Err(bad(format!("level-{level} node {p} lies outside the range of its context")));
    }
    if (e - s) as u64 > total {
        // every child has a count >= 1 and the counts sum to at most the total
        return Err(bad(format!("level-{level} context at node {s} has {} children but a total of {total}", e - s)));
    }
    let mut esc = 0u64;
    let (ws, we) = if e - s <= QUICK_WINDOW {
        check_children(ix, level, s, e, total, h.vocab_size, kids, &mut esc, h.esc_code())?;
        let sec = if level == 2 { Sec::TopK1 } else { Sec::TopK2 };
        check_topk_row(ix, sec, kids, large, scratch)?;
        (s, e)
    } else {
        let ws = p.saturating_sub(QUICK_WINDOW / 2).max(s);
        let we = (ws + QUICK_WINDOW).min(e);
        check_children(ix, level, ws, we, u64::MAX, h.vocab_size, kids, &mut esc, h.esc_code())?;
        let Some(r) = large else {
            return Err(bad(format!(
                "level-{level} context at node {s} has {} children but no top-{TOPK_K} row",
                e - s
            )));
        };
        check_topk_entries(ix, level, (s, e), r, kids)?;
        (ws, we)
    };
    // the escape ranks of the blocks just read
    for b in ws / BLOCK..we.div_ceil(BLOCK) {
        check_esc_block(ix, level, n, b)?;
    }
    Ok(())
}

/// The top-K row `r` of the large context `s..e` of `level` without decoding the context: K
/// entries by descending count (ties: ascending token), each a child of the context with that
/// count, and no child of the window `kids` read from it outside the row with a larger count
/// than the row's last.
fn check_topk_entries<D: AsRef<[u8]>>(
    ix: &Index<D>,
    level: u8,
    (s, e): (usize, usize),
    r: usize,
    kids: &[(u32, u64)],
) -> Result<()> {
    let sec = if level == 2 { Sec::TopK1 } else { Sec::TopK2 };
    let mut ch = crate::reader::Children::new();
    ix.topk_row_pub(sec, r, &mut ch)?;
    let row: Vec<(u32, u64)> = ch.tokens().iter().copied().zip(ch.counts().iter().copied()).collect();
    let ordered = row.windows(2).all(|w| w[0].1 > w[1].1 || (w[0].1 == w[1].1 && w[0].0 < w[1].0));
    let members = row.iter().all(|&(t, c)| ix.find_pub(level, s, e, t) == Some(c));
    let last = row.last().map_or(u64::MAX, |x| x.1);
    let beaten = kids.iter().any(|&(t, c)| c > last && !row.iter().any(|x| x.0 == t));
    if row.len() != TOPK_K || !ordered || !members || beaten {
        return Err(bad(format!("{} row {r} is not the top-{TOPK_K} of its context", sec.name())));
    }
    Ok(())
}

/// Top-K row `r` of `sec` on its own (one read, no search for its context): K entries, by
/// descending count (ties: ascending token), counts > 0, tokens < V.
fn check_topk_alone<D: AsRef<[u8]>>(ix: &Index<D>, sec: Sec, r: usize) -> Result<()> {
    let mut ch = crate::reader::Children::new();
    ix.topk_row_pub(sec, r, &mut ch)?;
    let v = ix.header().vocab_size;
    let row: Vec<(u32, u64)> = ch.tokens().iter().copied().zip(ch.counts().iter().copied()).collect();
    let ordered = row.windows(2).all(|w| w[0].1 > w[1].1 || (w[0].1 == w[1].1 && w[0].0 < w[1].0));
    if row.len() != TOPK_K || !ordered || row.iter().any(|&(t, c)| t >= v || c == 0) {
        return Err(bad(format!("{} row {r} is not a top-{TOPK_K} row (order, counts or token ids)", sec.name())));
    }
    Ok(())
}

/// The escape rank of the node block `b` of `level` agrees with the escapes in the block.
fn check_esc_block<D: AsRef<[u8]>>(ix: &Index<D>, level: u8, n: usize, b: usize) -> Result<()> {
    let (sec, nodes) = if level == 2 { (Sec::L2EscRank, Sec::L2Nodes) } else { (Sec::L3EscRank, Sec::L3Nodes) };
    let (_, _, esc_code) = ix.level_view(level);
    let ranks = ix.section(sec);
    let nodes = ix.section(nodes);
    let esc = (b * BLOCK..((b + 1) * BLOCK).min(n))
        .filter(|&i| get32(nodes, i * 4).unwrap_or(0) & esc_code == esc_code)
        .count();
    match (get64(ranks, b * 8), get64(ranks, (b + 1) * 8)) {
        (Some(r0), Some(r1)) if r1.checked_sub(r0) == Some(esc as u64) => Ok(()),
        _ => Err(bad(format!("{} block {b} disagrees with the escapes of its nodes", sec.name()))),
    }
}

/// The rank fields of L3_BLOCKS record `b` agree with record `b + 1`.
fn check_l3_block<D: AsRef<[u8]>>(ix: &Index<D>, b: usize) -> Result<()> {
    let blocks = ix.section(Sec::L3Blocks);
    let f = |r: usize, o: usize| get64(blocks, r * BLOCK3_LEN + o);
    let ok = (|| {
        let (base, large_bits, large_rank, ends_bits, ends_rank) =
            (f(b, 0)?, f(b, 8)?, f(b, 16)?, f(b, 24)?, f(b, 32)?);
        let (base1, large_rank1, ends_rank1) = (f(b + 1, 0)?, f(b + 1, 16)?, f(b + 1, 32)?);
        Some(
            base <= base1
                && large_rank.checked_add(u64::from(large_bits.count_ones())) == Some(large_rank1)
                && ends_rank.checked_add(u64::from(ends_bits.count_ones())) == Some(ends_rank1),
        )
    })();
    if ok == Some(true) {
        Ok(())
    } else {
        Err(bad(format!("L3_BLOCKS record {b} disagrees with the next one")))
    }
}

/// `Verify::Quick`: the CRC of every section of at most `QUICK_CRC_BYTES`, the unigram
/// invariants, and `QUICK_SAMPLES` sampled places of every larger section (FORMAT.md,
/// "Verification levels").
pub(crate) fn quick<D: AsRef<[u8]>>(ix: &Index<D>) -> Result<()> {
    quick_with(ix, QUICK_CRC_BYTES, QUICK_SAMPLES)
}

/// [`quick`] with sections over `crc_max` bytes sampled at `samples` places (the tests sample
/// every place of small files: 0, `usize::MAX`).
fn quick_with<D: AsRef<[u8]>>(ix: &Index<D>, crc_max: u64, samples: usize) -> Result<()> {
    let stats = ix.stats();
    let mut sampled = [false; SECTIONS.len()];
    for (i, &(_, len)) in stats.sections.iter().enumerate() {
        if len <= crc_max {
            check_crc(ix, i)?;
        } else {
            sampled[i] = true;
        }
    }
    let big = |s: Sec| sampled[s as usize - 1];
    check_unigrams(ix)?;
    let h = ix.header().clone();
    let seed = h.table_crc;
    let mut kids = Vec::new();
    let mut scratch = Vec::new();
    // Level 2: the one-token context holding each sampled node (UNI is checked, so its ranges
    // are contiguous and ascending, and in memory: the search costs no disk reads).
    let l2 = [Sec::L2Nodes, Sec::L2EscRank, Sec::L2Esc, Sec::TopK1, Sec::TopKEsc];
    if l2.iter().any(|&s| big(s)) {
        let mut last = usize::MAX;
        for p in strata(h.n_bigram, samples, seed) {
            let a = last_at_or_below(h.vocab_size as usize, p, |a| ix.ctx1_pub(a as u32).map(|c| c.0 as u64))?;
            let c = ix.ctx1_pub(a as u32).ok_or_else(|| bad(format!("bigram range of token {a}")))?;
            if c.1 - c.0 <= QUICK_WINDOW && a == last {
                continue;
            }
            last = a;
            check_place(ix, 2, c, p as usize, &mut kids, &mut scratch)?;
        }
    }
    // Top-K rows on their own (a sampled context rarely has one: 0.4 % of the bigram nodes
    // of the 107 M-node bench index)
    for (sec, n) in [(Sec::TopK1, h.n_large1), (Sec::TopK2, h.n_large2)] {
        if big(sec) || big(Sec::TopKEsc) {
            for r in strata(n, samples, seed ^ sec as u32) {
                check_topk_alone(ix, sec, r as usize)?;
            }
        }
    }
    // Level 3: sampled bigram nodes, their trigram range (L3_BLOCKS, L3_DELTA, L3_WIDE, ENDS)
    // and context. Sampled by bigram node rather than
    // by trigram node: no search, so about five page reads a sample on a cold file (a search
    // over the trigram starts cost ~35, 2.2 s on a cold 1.3 GB index).
    let l3 = [
        Sec::L3Blocks,
        Sec::L3Delta,
        Sec::L3Wide,
        Sec::Ends,
        Sec::L3Nodes,
        Sec::L3EscRank,
        Sec::L3Esc,
        Sec::TopK2,
        Sec::TopKEsc,
    ];
    if l3.iter().any(|&s| big(s)) {
        for j in strata(h.n_bigram, samples, seed ^ 0x5bd1_e995) {
            let j = j as usize;
            let c = ix.ctx2_pub(j).ok_or_else(|| bad(format!("trigram range of bigram node {j}")))?;
            check_l3_block(ix, j / BLOCK)?;
            // the trigram ranges of the whole block (its records, deltas and bigram nodes are
            // read already): a damaged delta moves children between neighbours, and one of
            // them then has more children than its total
            for jj in j / BLOCK * BLOCK..((j / BLOCK + 1) * BLOCK).min(h.n_bigram as usize) {
                let (s, e, total, _) =
                    ix.ctx2_pub(jj).ok_or_else(|| bad(format!("trigram range of bigram node {jj}")))?;
                if (e - s) as u64 > total {
                    return Err(bad(format!("bigram node {jj} has {} trigram children but a total of {total}", e - s)));
                }
            }
            if c.1 > c.0 {
                let p = c.0 + (j.wrapping_mul(0x9e37_79b9) >> 7) % (c.1 - c.0);
                check_place(ix, 3, c, p, &mut kids, &mut scratch)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{parse, Section};
    use crate::{BuildOptions, Builder};

    /// An index over a skewed random corpus (contexts with more than `QUICK_WINDOW` and
    /// more than `TOPK_K` children; 11 count bits, so frequent n-grams have escaped counts).
    fn build(seed: u64, vocab: u32, tokens: usize) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let doc: Vec<u32> = (0..tokens)
            .map(|_| {
                let u = (next() >> 11) as f64 / (1u64 << 53) as f64;
                ((u * u * u * vocab as f64) as u32).min(vocab - 1)
            })
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("q.idx");
        let mut b =
            Builder::new(BuildOptions { vocab_size: vocab, token_bits: Some(21), ..Default::default() }).unwrap();
        b.add_documents(&doc.chunks(5000).collect::<Vec<_>>()).unwrap();
        b.finish(&out, "{}").unwrap();
        std::fs::read(out).unwrap()
    }

    fn section(bytes: &[u8], s: Sec) -> Section {
        parse(bytes).unwrap().1[s as usize - 1]
    }

    #[test]
    fn sampled_checks_accept_intact_indexes() {
        let mut exercised = (false, false);
        for (seed, vocab, tokens) in [(1, 50, 20_000), (2, 3_000, 200_000), (3, 400, 300_000), (5, 20, 200_000)] {
            let bytes = build(seed, vocab, tokens);
            let ix = Index::from_bytes(bytes).unwrap();
            verify(&ix).unwrap();
            quick(&ix).unwrap();
            quick_with(&ix, 0, QUICK_SAMPLES).unwrap();
            quick_with(&ix, 0, usize::MAX).unwrap();
            let h = ix.header();
            exercised.0 |= h.n_large2 > 0;
            exercised.1 |= h.n_esc3 > 0;
        }
        assert_eq!(exercised, (true, true), "the corpora have level-3 top-K rows and escaped counts");
    }

    #[test]
    fn sampled_checks_catch_structural_damage() {
        let good = build(4, 2_000, 150_000);
        let node = |b: &[u8], s: Sec, i: usize| section(b, s).offset as usize + 4 * i;
        type Damage<'a> = Box<dyn Fn(&mut Vec<u8>) + 'a>;
        let damaged: Vec<(&str, Damage<'_>)> = vec![
            (
                "level-3 children swapped",
                Box::new(|b: &mut Vec<u8>| {
                    let ix = Index::from_bytes(b.clone()).unwrap();
                    let small = (0..ix.header().n_bigram as usize)
                        .filter_map(|j| ix.ctx2_pub(j))
                        .find(|c| (2..=QUICK_WINDOW).contains(&(c.1 - c.0)) && c.0 > 100)
                        .unwrap();
                    let o = node(b, Sec::L3Nodes, small.0);
                    let (w0, w1) = (b[o..o + 4].to_vec(), b[o + 4..o + 8].to_vec());
                    b[o..o + 4].copy_from_slice(&w1);
                    b[o + 4..o + 8].copy_from_slice(&w0);
                }),
            ),
            (
                "level-2 token out of range",
                Box::new(|b: &mut Vec<u8>| {
                    let o = node(b, Sec::L2Nodes, 500);
                    b[o + 3] = 0xFF;
                }),
            ),
            (
                "level-2 zero count",
                Box::new(|b: &mut Vec<u8>| {
                    let o = node(b, Sec::L2Nodes, 700);
                    let w = u32::from_le_bytes(b[o..o + 4].try_into().unwrap()) & !((1 << 11) - 1);
                    b[o..o + 4].copy_from_slice(&w.to_le_bytes());
                }),
            ),
            (
                "trigram start moved",
                Box::new(|b: &mut Vec<u8>| {
                    let o = section(b, Sec::L3Delta).offset as usize + 2 * 10;
                    b[o + 1] ^= 0x40;
                }),
            ),
            (
                "L3_BLOCKS rank",
                Box::new(|b: &mut Vec<u8>| {
                    let o = section(b, Sec::L3Blocks).offset as usize + BLOCK3_LEN + 16;
                    b[o] ^= 0x01;
                }),
            ),
            (
                "escape rank",
                Box::new(|b: &mut Vec<u8>| {
                    let o = section(b, Sec::L3EscRank).offset as usize + 8 * 3;
                    b[o] ^= 0x01;
                }),
            ),
        ];
        for (what, damage) in damaged {
            let mut b = good.clone();
            damage(&mut b);
            let ix = Index::from_bytes(b).unwrap();
            assert!(quick(&ix).is_err(), "{what}: the CRC of a small index");
            assert!(quick_with(&ix, 0, usize::MAX).is_err(), "{what}: the sampled checks");
        }
    }
}
