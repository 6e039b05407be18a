//! Measurement helpers for benchmarks (`tools/bench_tree.py`, criterion): per-search wall
//! times on the calling thread, the share of that time spent in index lookups, and batched
//! timings on the pool. Not used by the searches themselves.
use std::sync::Mutex;
use std::time::Instant;

use crate::{beam_search, beam_search_batch, NgramScorer, Result, SearchParams, TopkRows};

/// What [`time_beam_search`] measured.
#[derive(Debug, Clone, Default)]
pub struct SearchTiming {
    /// Wall time of every single search (ns), one thread, in input order.
    pub search_ns: Vec<u64>,
    /// CPU time of the calling thread for every single search (ns): what the search costs
    /// when the machine is shared (wall time also counts time the thread was descheduled).
    pub search_cpu_ns: Vec<u64>,
    /// Sum of `search_ns`.
    pub search_total_ns: u64,
    /// Sum of `search_cpu_ns`.
    pub search_total_cpu_ns: u64,
    /// Thread CPU time to replay every index query (`cond_probs`, `trigram_probs`,
    /// `trigram_context`, `trigram_probs_at`, `backoff_bound`) those searches issued, in one
    /// tight loop (ns): the index-lookup part of `search_total_cpu_ns`.
    pub ngram_total_cpu_ns: u64,
    /// Number of index queries (all the kinds above) per search, summed.
    pub ngram_queries: u64,
    /// Number of candidates in those queries, summed.
    pub ngram_candidates: u64,
    /// Wall time of each batch of `batch` searches run with [`beam_search_batch`] (ns).
    pub batch_ns: Vec<u64>,
}

/// CPU time consumed by the calling thread (ns), 0 where the clock is unavailable.
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime only writes the timespec we pass, which lives on our stack.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// One index query of a search, as recorded for the replay.
enum Query {
    Cond(Vec<u32>, Vec<u32>),
    Trigram([u32; 2], Vec<u32>),
    TrigramContext([u32; 2]),
    TrigramAt([u32; 2], [u64; 3], Vec<u32>),
    BackoffBound(u32),
}

/// Records the queries a search makes, forwarding them to the real scorer.
struct Recorder<'a, S: ?Sized> {
    inner: &'a S,
    log: Mutex<Vec<Query>>,
}

impl<S: ?Sized> Recorder<'_, S> {
    fn push(&self, q: Query) {
        self.log.lock().unwrap_or_else(|p| p.into_inner()).push(q);
    }
}

impl<S: NgramScorer + ?Sized> NgramScorer for Recorder<'_, S> {
    fn vocab_size(&self) -> u32 {
        self.inner.vocab_size()
    }
    fn cond_probs(&self, c: &[u32], v: &[u32], u: bool, out: &mut [f64]) {
        self.push(Query::Cond(c.to_vec(), v.to_vec()));
        self.inner.cond_probs(c, v, u, out)
    }
    fn trigram_probs(&self, c: [u32; 2], v: &[u32], out: &mut [f64]) {
        self.push(Query::Trigram(c, v.to_vec()));
        self.inner.trigram_probs(c, v, out)
    }
    fn trigram_context(&self, c: [u32; 2]) -> ([u64; 3], f64) {
        self.push(Query::TrigramContext(c));
        self.inner.trigram_context(c)
    }
    fn trigram_probs_at(&self, c: [u32; 2], h: [u64; 3], v: &[u32], out: &mut [f64]) {
        self.push(Query::TrigramAt(c, h, v.to_vec()));
        self.inner.trigram_probs_at(c, h, v, out)
    }
    fn backoff_bound(&self, b: u32, u: bool) -> f64 {
        self.push(Query::BackoffBound(b));
        self.inner.backoff_bound(b, u)
    }
    fn top_children(&self, c: &[u32], k: usize, u: bool, t: &mut Vec<u32>, p: &mut Vec<f64>) -> Result<()> {
        self.inner.top_children(c, k, u, t, p)
    }
}

/// Time `contexts.len()` searches (inputs laid out as for [`beam_search_batch`]): one warm-up
/// pass, then each search timed alone; then the n-gram queries of all searches replayed and
/// timed; then batches of `batch` searches on the pool (0 = skip).
pub fn time_beam_search<S: NgramScorer + ?Sized>(
    scorer: &S,
    contexts: &[&[u32]],
    rows: TopkRows<'_>,
    params: &SearchParams,
    batch: usize,
) -> Result<SearchTiming> {
    let TopkRows { tokens: topk_tokens, logprobs: topk_logprobs, d, k } = rows;
    let per = d * k;
    let row =
        |b: usize| TopkRows::new(&topk_tokens[b * per..(b + 1) * per], &topk_logprobs[b * per..(b + 1) * per], d, k);
    // Warm-up (page cache, branch predictors, thread-local buffers) and query log.
    let rec = Recorder { inner: scorer, log: Mutex::new(Vec::new()) };
    for (b, ctx) in contexts.iter().enumerate() {
        beam_search(&rec, ctx, row(b), params)?;
    }
    let mut t = SearchTiming::default();
    for (b, ctx) in contexts.iter().enumerate() {
        let rows_b = row(b);
        let c0 = thread_cpu_ns();
        let t0 = Instant::now();
        let tree = beam_search(scorer, ctx, rows_b, params)?;
        t.search_ns.push(t0.elapsed().as_nanos() as u64);
        t.search_cpu_ns.push(thread_cpu_ns().saturating_sub(c0));
        std::hint::black_box(tree);
    }
    t.search_total_ns = t.search_ns.iter().sum();
    t.search_total_cpu_ns = t.search_cpu_ns.iter().sum();
    let log = rec.log.into_inner().unwrap_or_else(|p| p.into_inner());
    t.ngram_queries = log.len() as u64;
    t.ngram_candidates = log
        .iter()
        .map(|q| match q {
            Query::Cond(_, v) | Query::Trigram(_, v) | Query::TrigramAt(_, _, v) => v.len() as u64,
            Query::TrigramContext(_) | Query::BackoffBound(_) => 0,
        })
        .sum();
    let mut out = vec![0.0; k.max(1)];
    let c0 = thread_cpu_ns();
    for q in &log {
        match q {
            Query::Cond(c, v) => scorer.cond_probs(c, v, params.unigram_backoff, &mut out[..v.len()]),
            Query::Trigram(c, v) => scorer.trigram_probs(*c, v, &mut out[..v.len()]),
            Query::TrigramContext(c) => out[0] = scorer.trigram_context(*c).1,
            Query::TrigramAt(c, h, v) => scorer.trigram_probs_at(*c, *h, v, &mut out[..v.len()]),
            Query::BackoffBound(b) => out[0] = scorer.backoff_bound(*b, params.unigram_backoff),
        }
        std::hint::black_box(&out);
    }
    t.ngram_total_cpu_ns = thread_cpu_ns().saturating_sub(c0);
    if batch > 0 {
        for start in (0..contexts.len()).step_by(batch) {
            let end = (start + batch).min(contexts.len());
            if end - start < batch {
                break;
            }
            let t0 = Instant::now();
            let trees = beam_search_batch(
                scorer,
                &contexts[start..end],
                TopkRows::new(&topk_tokens[start * per..end * per], &topk_logprobs[start * per..end * per], d, k),
                params,
            )?;
            t.batch_ns.push(t0.elapsed().as_nanos() as u64);
            std::hint::black_box(trees);
        }
    }
    Ok(t)
}
