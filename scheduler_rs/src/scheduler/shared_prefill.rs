//! Prompts queued together with a shared prefix compute it once (docs/architecture.md, "Prefix caching",
//! "Prompts sharing a prefix in flight").
//!
//! A request resumes only from a state snapshot, so prompts that arrive together with a shared prefix (agents
//! fanned out over one system prompt, a batch of requests over one document) would each compute the whole
//! prefix: none of them finds a snapshot when it starts. Two rules avoid that:
//!
//! - **The first one snapshots where they diverge.** A request admitted while waiting requests share its
//!   leading full blocks (same root, same chained hashes) cuts a chunk and snapshots at the deepest such
//!   boundary (`sibling_divergence`), as it does at the divergence from cached blocks.
//! - **The others wait for that snapshot.** A waiting request that holds no blocks is skipped, keeping its
//!   place, while a request in its prefill will snapshot on its chain deeper than the request could resume
//!   today (`awaits_snapshot`): a pending `snapshot_at`, or one this step's plan takes (ready next step).
//!   Prompts behind it that share nothing go on, as behind the multimodal gate.
//!
//! The wait is bounded: the snapshot is taken when the computing request's chunk reaches the boundary, and a
//! computing request that is aborted, preempted or finished no longer counts. Where snapshots are off
//! (`num_state_snapshots == 0`) neither rule applies.

use super::Scheduler;
use crate::request::Request;

impl Scheduler {
    /// Whether snapshots can serve requests that share a prefix (prefix caching on, with a snapshot pool).
    fn snapshots_on(&self) -> bool {
        self.config.enable_prefix_caching && self.config.num_state_snapshots > 0
    }

    /// The deepest full-block boundary that another waiting request, not yet started and allowed to resume
    /// from the cache, shares with this one (0 where none).
    pub(super) fn sibling_divergence(&self, handle: usize) -> u32 {
        let req = self.req(handle);
        if !self.snapshots_on() || req.prefix_root.is_none() {
            return 0;
        }
        let num_blocks = self
            .waiting
            .iter()
            .filter(|&&h| h != handle)
            .map(|&h| self.req(h))
            .filter(|other| other.block_table.is_empty() && other.prefix_lookup && other.prefix_root == req.prefix_root)
            .filter(|other| !other.block_hashes.is_empty() && other.block_hashes.first() == req.block_hashes.first())
            .map(|other| num_common_blocks(&req.block_hashes, &other.block_hashes))
            .max()
            .unwrap_or(0);
        num_blocks as u32 * self.config.block_size
    }

    /// The snapshots that requests already in their prefill will take (`snapshot_at`): (request, boundary).
    pub(super) fn pending_snapshots(&self) -> Vec<(usize, u32)> {
        if !self.snapshots_on() {
            return Vec::new();
        }
        self.waiting
            .iter()
            .filter(|&&h| !self.req(h).block_table.is_empty())
            .flat_map(|&h| self.req(h).snapshot_at.iter().map(move |&at| (h, at)))
            .collect()
    }

    /// Whether a waiting request that holds no blocks should wait for a snapshot another request's prefill
    /// is about to take on its chain, deeper than where it could resume now. `pending`: (request, boundary)
    /// of the snapshots requests in their prefill will take (`pending_snapshots`) or this step's plan takes
    /// (not yet ready).
    pub(super) fn awaits_snapshot(&self, handle: usize, pending: &[(usize, u32)]) -> bool {
        let req = self.req(handle);
        if pending.is_empty() || !req.prefix_lookup || req.prefix_root.is_none() {
            return false;
        }
        let deepest = pending
            .iter()
            .filter(|&&(h, at)| h != handle && self.serves(self.req(h), at, req))
            .map(|&(_, at)| at)
            .max();
        deepest.is_some_and(|at| at > self.resume_boundary(handle))
    }

    /// Whether a snapshot `computing` takes at `boundary` is one `waiting` could resume from: a full-block
    /// boundary inside `waiting`'s prompt on the same chain.
    fn serves(&self, computing: &Request, boundary: u32, waiting: &Request) -> bool {
        let block_size = self.config.block_size;
        let depth = (boundary / block_size) as usize;
        boundary.is_multiple_of(block_size)
            && depth > 0
            && boundary < waiting.len()
            && computing.prefix_root == waiting.prefix_root
            && depth <= computing.block_hashes.len().min(waiting.block_hashes.len())
            && computing.block_hashes[depth - 1] == waiting.block_hashes[depth - 1]
    }
}

/// The number of leading full blocks two chains share. The hashes are chained (each names every block before
/// it), so equal hashes at a depth mean equal chains up to it, and the shared depth is found by bisection.
fn num_common_blocks(a: &[u64], b: &[u64]) -> usize {
    let (mut lo, mut hi) = (0, a.len().min(b.len()));
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if a[mid - 1] == b[mid - 1] {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

#[cfg(test)]
mod tests {
    use super::num_common_blocks;

    #[test]
    fn common_blocks_of_chained_hashes() {
        assert_eq!(num_common_blocks(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(num_common_blocks(&[1, 2, 3], &[1, 2, 3]), 3);
        assert_eq!(num_common_blocks(&[1], &[9, 1]), 0);
        assert_eq!(num_common_blocks(&[], &[1]), 0);
    }
}
