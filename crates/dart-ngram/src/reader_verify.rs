//! `Index::verify`: the opt-in O(file size) check of everything `open` does not check.

use crate::error::{Error, Result};
use crate::format::{get32, get64, Sec, BLOCK, SECTIONS, TOPK_K, TOPK_ROW, UNI_LEN};
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

pub(crate) fn verify<D: AsRef<[u8]>>(ix: &Index<D>) -> Result<()> {
    for (i, s) in SECTIONS.iter().enumerate() {
        if ix.section_crc_ok(i) != Some(true) {
            return Err(bad(format!("checksum mismatch in section {}: the file is corrupt", s.name())));
        }
    }
    let h = ix.header().clone();
    let v = h.vocab_size;
    // unigrams
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
    let is_large = kids.len() > TOPK_K;
    match (is_large, large) {
        (false, None) => Ok(()),
        (true, Some(r)) if r == *next_rank => {
            *next_rank += 1;
            let want = top_positions(kids, TOPK_K, scratch);
            let mut ch = crate::reader::Children::new();
            ix.topk_row_pub(sec, r, &mut ch)?;
            let got: Vec<(u32, u64)> = ch.tokens().iter().copied().zip(ch.counts().iter().copied()).collect();
            let want: Vec<(u32, u64)> = want.iter().map(|&p| kids[p as usize]).collect();
            if got != want {
                return Err(bad(format!("{} row {r} is not the top-{TOPK_K} of its context", sec.name())));
            }
            let _ = TOPK_ROW;
            Ok(())
        }
        _ => Err(bad(format!("{}: large-context flags are inconsistent", sec.name()))),
    }
}
