//! The files a build writes besides its output: output checks, and temporary files that are
//! created locked so that a later build removes those of a crashed one.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

pub(super) const SECTIONS_PREFIX: &str = ".dart-ngram-sections-";
pub(super) const RUNS_PREFIX: &str = "dart-ngram-runs-";
pub(super) const PARTIAL_PREFIX: &str = ".dart-ngram-";

/// Fail before any work when the index cannot be written at `output`: a directory, a
/// missing parent directory, or one of the runs being merged (writing over an input).
pub(super) fn check_output(output: &Path, inputs: &[PathBuf]) -> Result<()> {
    if output.is_dir() {
        return Err(Error::InvalidOption(format!(
            "output {} is a directory; give a file path such as {}",
            output.display(),
            output.join("corpus.idx").display()
        )));
    }
    let parent = parent_dir(output);
    if !parent.is_dir() {
        return Err(Error::InvalidOption(format!(
            "cannot write {}: directory {} does not exist; create it first",
            output.display(),
            parent.display()
        )));
    }
    if let Ok(out) = std::fs::metadata(output) {
        use std::os::unix::fs::MetadataExt;
        for p in inputs {
            if let Ok(m) = std::fs::metadata(p) {
                if m.dev() == out.dev() && m.ino() == out.ino() {
                    return Err(Error::InvalidOption(format!(
                        "output {} is one of the inputs ({}); write the index to another path",
                        output.display(),
                        p.display()
                    )));
                }
            }
        }
    }
    Ok(())
}

/// Temporary files of builds: each is created locked (flock) and a later build removes the
/// ones whose lock is free, i.e. whose process died (kill -9, a crash) before cleaning up.
/// Only names this builder makes are touched, in the directories it writes to.
pub(super) mod stale {
    use super::*;
    use std::os::unix::io::AsRawFd;

    const LOCK: &str = ".lock";

    /// `flock(LOCK_EX | LOCK_NB)`: true when this process now holds the lock.
    pub(in crate::builder) fn try_lock(f: &File) -> bool {
        // SAFETY: flock only reads the descriptor, which `f` keeps open for the call.
        unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) == 0 }
    }

    /// A fresh temp dir `base/<prefix>XXXX` holding a locked `.lock`. The lock file is made
    /// under another name, locked, then renamed to `.lock`, so a `.lock` is never seen
    /// unlocked while its builder lives.
    pub(in crate::builder) fn locked_tempdir(base: &Path, prefix: &str) -> Result<(tempfile::TempDir, File)> {
        let dir = tempfile::Builder::new().prefix(prefix).tempdir_in(base).map_err(|e| Error::io(base, e))?;
        let tmp = dir.path().join(".lock.new");
        let f = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        try_lock(&f);
        std::fs::rename(&tmp, dir.path().join(LOCK)).map_err(|e| Error::io(&tmp, e))?;
        Ok((dir, f))
    }

    /// Remove the stale temporary files of builds in `dir` (errors are ignored: cleaning
    /// up is best effort and must never fail a build).
    pub(in crate::builder) fn sweep(dir: &Path) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for e in rd.flatten() {
            let name = e.file_name();
            let Some(name) = name.to_str() else { continue };
            let path = e.path();
            let Ok(meta) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            if meta.is_dir() && (name.starts_with(SECTIONS_PREFIX) || name.starts_with(RUNS_PREFIX)) {
                // A dir without `.lock` is still being set up by a live builder (a
                // microsecond window), unless it is old.
                let lock = path.join(LOCK);
                let stale = match File::open(&lock) {
                    Ok(f) => try_lock(&f),
                    Err(_) => older_than(&meta, 600),
                };
                if stale {
                    let _ = std::fs::remove_dir_all(&path);
                }
            } else if meta.is_file() && name.starts_with(PARTIAL_PREFIX) && name.ends_with(".partial") {
                // Locked right after creation; the age check covers that window.
                if older_than(&meta, 2) && File::open(&path).is_ok_and(|f| try_lock(&f)) {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
    }

    fn older_than(meta: &std::fs::Metadata, secs: u64) -> bool {
        meta.modified().ok().and_then(|t| t.elapsed().ok()).is_some_and(|d| d.as_secs() >= secs)
    }
}

pub(super) fn parent_dir(p: &Path) -> PathBuf {
    match p.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    }
}
