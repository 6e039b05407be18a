//! dart-live: what a decoder has served, as a bounded n-gram layer beside the static index.
//!
//! * [`Window`]: the most recent tokens (prompts and outputs, one document each), at most
//!   `capacity` of them, the oldest leaving first (FIFO); their bigram and trigram counts and a
//!   table from each two-token key to where it occurred, for [`Window::suffix_match`] (the
//!   longest earlier match of a context's end and what followed it, as suffix decoding does).
//! * [`Mixed`]: Eq. (10)'s g(v | c) over a static scorer and a window together.
//! * [`context_match`]: the same kind of match inside one context (prompt lookup).
//! * [`LiveLayer`]: a window that searches read while inserts go on: two copies, one
//!   published for readers, the other written (and brought up to date) by the writer. A
//!   reader takes the published copy (one `Arc` clone under a lock held for that clone alone)
//!   and never waits on an insert; the writer waits for the last reader of the copy it is
//!   about to write (a reader holding it for longer costs the writer a fresh copy of the
//!   published one, never a deadlock). Memory is twice the window's. It also holds the
//!   *shared deltas* ([`LiveLayer::set_shared`]): other processes' windows, written as delta
//!   indexes ([`write_delta`]) and mapped here, whose counts [`Mixed`] adds to the window's.
use std::sync::{Arc, Mutex, PoisonError, RwLock};

mod delta;
mod lookup;
mod mixed;
mod table;
mod window;

pub use delta::{open_delta, write_delta, Delta};
pub use lookup::context_match;
pub use mixed::{live_probs, Mixed};
use window::Op;
pub use window::Window;

/// λ of the mix ([`Mixed`]) where the layer knows the context's last token: the one default
/// of the searches' `live_weight` (the Python bindings and package read it from here).
/// Chosen by `tools/bench_live.py --weights`: λ changes which tokens a tree holds, not its size
/// or what a round costs, so τ decides; τ on the repetitive workloads rose with λ over 0.25,
/// 0.5, 0.75 for dart+mix and dart+live alike and stayed level on fresh prompts (docs/live.md).
pub const LIVE_WEIGHT: f64 = 0.75;

/// What the live layer refuses.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum Error {
    #[error("parameter {name} = {value} is invalid: {why}")]
    Param { name: &'static str, value: f64, why: &'static str },
    #[error("token id {token} at position {position} is outside the vocabulary (size {vocab}): the ids come from another tokenizer, or are corrupt")]
    TokenOutOfVocab { position: usize, token: u32, vocab: u32 },
}

/// Yields a writer waits for the last reader of its copy before copying the published one.
const MAX_SPINS: usize = 10_000;

struct Writer {
    /// The copy readers are not given; `pending` brings it up to date.
    spare: Option<Arc<Window>>,
    pending: Vec<Op>,
}

/// A [`Window`] shared between searching threads and one writer at a time (see the crate docs).
pub struct LiveLayer {
    published: RwLock<Arc<Window>>,
    writer: Mutex<Writer>,
    shared: RwLock<Arc<[Arc<Delta>]>>,
}

impl LiveLayer {
    /// An empty layer keeping at most `capacity` tokens of ids below `vocab`.
    pub fn new(capacity: usize, vocab: u32) -> Result<Self, Error> {
        let w = Window::new(capacity, vocab)?;
        Ok(LiveLayer {
            published: RwLock::new(Arc::new(w.clone())),
            writer: Mutex::new(Writer { spare: Some(Arc::new(w)), pending: Vec::new() }),
            shared: RwLock::new(Arc::from(Vec::new())),
        })
    }

    /// The shared deltas searches read beside the window (see [`Mixed`]).
    pub fn shared(&self) -> Arc<[Arc<Delta>]> {
        self.shared.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Replace the shared deltas (each of this layer's vocabulary); searches already running
    /// keep the set they started with.
    pub fn set_shared(&self, deltas: Vec<Arc<Delta>>) -> Result<(), Error> {
        let vocab = self.snapshot().vocab_size();
        if let Some(d) = deltas.iter().find(|d| d.vocab_size() != vocab) {
            return Err(Error::Param {
                name: "shared delta vocab_size",
                value: d.vocab_size() as f64,
                why: "must be the layer's own vocabulary size",
            });
        }
        *self.shared.write().unwrap_or_else(PoisonError::into_inner) = Arc::from(deltas);
        Ok(())
    }

    /// The window as of the last finished insert; hold it for one search.
    pub fn snapshot(&self) -> Arc<Window> {
        self.published.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Append one document (a prompt, an accepted output). Checked first: an id outside the
    /// vocabulary changes nothing.
    pub fn insert(&self, ids: &[u32]) -> Result<(), Error> {
        self.snapshot().check(ids)?;
        self.write(Op::Insert(ids.to_vec()));
        Ok(())
    }

    /// Forget everything.
    pub fn clear(&self) {
        self.write(Op::Clear);
    }

    fn write(&self, op: Op) {
        let mut w = self.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let mut spare = w.spare.take().expect("the writer always holds the spare copy between writes");
        // Readers that took this copy before it was unpublished finish one search each; one
        // that keeps it longer (a snapshot held across writes) gets its own copy instead.
        let mut spins = 0;
        while Arc::get_mut(&mut spare).is_none() && spins < MAX_SPINS {
            std::thread::yield_now();
            spins += 1;
        }
        if Arc::get_mut(&mut spare).is_none() {
            spare = Arc::new(Window::clone(&self.snapshot()));
            w.pending.clear(); // the published copy has every earlier write
        }
        if let Some(window) = Arc::get_mut(&mut spare) {
            for p in w.pending.drain(..) {
                window.apply(&p);
            }
            window.apply(&op);
        }
        let old = std::mem::replace(&mut *self.published.write().unwrap_or_else(PoisonError::into_inner), spare);
        w.spare = Some(old);
        w.pending.push(op);
    }
}

#[cfg(test)]
mod tests;
