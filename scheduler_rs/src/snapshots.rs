//! State snapshots: copies of a request's state slot taken right after it computed exactly `boundary`
//! positions, so another request whose tokens start with the same `boundary` tokens resumes there
//! (docs/architecture.md, "Prefix caching").
//!
//! A snapshot is named by its key (the last hash of its chain of full blocks before the boundary, which
//! names them all, or the chain's root, the model and salt, for a boundary inside the first block) and its tail (the tokens after the last full block, shorter than a block), whose
//! compressed entries live in the snapshot's own tail block. Snapshots live in a pool of their own,
//! evicted least recently used when it is full; a snapshot is dropped with any block of its chain.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::block_manager::BlockManager;

#[derive(Debug, Clone)]
pub struct Snapshot {
    /// The last hash of `chain`, or the chain's root (`block_hash.root_hash`) when `chain` is empty.
    pub key: u64,
    /// Hashes of the full blocks before the boundary.
    pub chain: Vec<u64>,
    /// Tokens after the last full block, up to the boundary (shorter than a block).
    pub tail: Vec<u32>,
    /// The block holding the tail's entries (a reference the snapshot holds); None without a tail.
    pub tail_block: Option<u32>,
    /// The first step whose plan may restore it (its copy runs before that step's forward).
    pub ready_step: u64,
    /// Taken at a prompt's end or a finished request's: a later prompt resuming here extends an earlier
    /// sequence token for token (false: at a chunk cut, where prompts diverged or may).
    pub at_end: bool,
}

/// What a dropped snapshot gives back: its tail block (for the caller to free) and its worker slot (whose
/// save copy, if not yet run, the caller cancels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dropped {
    pub tail_block: Option<u32>,
    pub worker_slot: u32,
}

impl Snapshot {
    pub fn boundary(&self, block_size: u32) -> u32 {
        self.chain.len() as u32 * block_size + self.tail.len() as u32
    }
}

#[derive(Debug, Clone)]
pub struct Snapshots {
    pool: BlockManager,
    /// Indexed by snapshot id (the pool's ids).
    slab: Vec<Option<Snapshot>>,
    /// Snapshots by the last hash of their chain.
    by_last: HashMap<u64, Vec<u32>>,
    /// Snapshots by every hash of their chain (dropped with any of those blocks).
    dependents: HashMap<u64, Vec<u32>>,
    lru: BTreeMap<u64, u32>,
    last_use: Vec<u64>,
    /// Snapshots a restore of the step being planned reads: never dropped until that plan is out (their
    /// save copy may run in the same plan, just before the restore).
    pinned: HashSet<u32>,
    next_tick: u64,
    /// Worker state-slot id of snapshot 1 (snapshots follow the request slots in the worker's pool).
    first_worker_slot: u32,
}

impl Snapshots {
    pub fn new(num_snapshots: u32, first_worker_slot: u32) -> Self {
        Snapshots {
            pool: BlockManager::new("state snapshot", num_snapshots + 1),
            slab: vec![None; num_snapshots as usize + 1],
            by_last: HashMap::new(),
            dependents: HashMap::new(),
            lru: BTreeMap::new(),
            last_use: vec![0; num_snapshots as usize + 1],
            pinned: HashSet::new(),
            next_tick: 0,
            first_worker_slot,
        }
    }

    pub fn pool(&self) -> &BlockManager {
        &self.pool
    }

    pub fn num_held(&self) -> u32 {
        self.pool.num_held()
    }

    /// The worker's state slot of snapshot `id`.
    pub fn worker_slot(&self, id: u32) -> u32 {
        self.first_worker_slot + id - 1
    }

    pub fn get(&self, id: u32) -> &Snapshot {
        self.slab[id as usize].as_ref().expect("a live snapshot")
    }

    /// A save at a prompt's end or a finished request's found this snapshot already there.
    pub fn mark_at_end(&mut self, id: u32) {
        self.slab[id as usize].as_mut().expect("a live snapshot").at_end = true;
    }

    /// The tail blocks the snapshots hold.
    pub fn tail_blocks(&self) -> impl Iterator<Item = u32> + '_ {
        self.slab.iter().flatten().filter_map(|s| s.tail_block)
    }

    /// Whether dropping `id` gives a block back: unpinned, with a tail block no one else holds (a finished
    /// request's partial block may still wait for its in-flight step).
    fn frees_a_block(&self, id: u32, blocks: &BlockManager) -> bool {
        !self.pinned.contains(&id) && self.get(id).tail_block.is_some_and(|b| blocks.ref_count(b) == 1)
    }

    /// Blocks that dropping snapshots gives back.
    pub fn num_tail_blocks(&self, blocks: &BlockManager) -> u32 {
        self.lru.values().filter(|&&id| self.frees_a_block(id, blocks)).count() as u32
    }

    /// Keeps `id` until `unpin_all` (a restore in the step being planned reads it).
    pub fn pin(&mut self, id: u32) {
        self.pinned.insert(id);
    }

    /// The step's plan is out: its restores are in it.
    pub fn unpin_all(&mut self) {
        self.pinned.clear();
    }

    /// Drops the least recently used snapshot whose dropping gives a block back.
    pub fn evict_tail_block(&mut self, blocks: &BlockManager) -> Option<Dropped> {
        let id = self.lru.values().copied().find(|&id| self.frees_a_block(id, blocks))?;
        Some(self.remove(id))
    }

    /// The deepest snapshot usable at step `step` by a request with chain root `root`, full-block hashes
    /// `hashes` (of which the first `num_cached` are cached) and tokens `tokens`, resuming at most at
    /// `max_boundary` and where `tail_ok(start, end)` allows a tail over positions `start..end`: (id, boundary).
    #[allow(clippy::too_many_arguments)]
    pub fn find(
        &self,
        root: u64,
        hashes: &[u64],
        num_cached: usize,
        tokens: &[u32],
        max_boundary: u32,
        block_size: u32,
        step: u64,
        tail_ok: impl Fn(u32, u32) -> bool,
    ) -> Option<(u32, u32)> {
        for depth in (0..=num_cached.min(hashes.len())).rev() {
            let start = depth as u32 * block_size;
            let key = if depth == 0 { root } else { hashes[depth - 1] };
            let best = self
                .by_last
                .get(&key)
                .into_iter()
                .flatten()
                .map(|&id| (id, self.get(id)))
                .filter(|(_, s)| s.chain.len() == depth && s.ready_step <= step)
                .map(|(id, s)| (id, start + s.tail.len() as u32, &s.tail))
                .filter(|&(_, end, tail)| {
                    end > 0
                        && end <= max_boundary
                        && tokens.get(start as usize..end as usize) == Some(tail.as_slice())
                        && (tail.is_empty() || tail_ok(start, end))
                })
                .max_by_key(|&(id, end, _)| (end, id));
            if let Some((id, end, _)) = best {
                return Some((id, end));
            }
        }
        None
    }

    /// A snapshot with this chain and tail, if one exists (ready or not).
    pub fn find_exact(&self, key: u64, depth: usize, tail: &[u32]) -> Option<u32> {
        self.by_last.get(&key)?.iter().copied().find(|&id| {
            let s = self.get(id);
            s.chain.len() == depth && s.tail == tail
        })
    }

    /// Marks a snapshot used now (LRU).
    pub fn touch(&mut self, id: u32) {
        self.unlist_lru(id);
        let tick = self.next_tick;
        self.next_tick += 1;
        self.last_use[id as usize] = tick;
        self.lru.insert(tick, id);
    }

    fn unlist_lru(&mut self, id: u32) {
        let tick = self.last_use[id as usize];
        if self.lru.get(&tick) == Some(&id) {
            self.lru.remove(&tick);
        }
    }

    /// Stores a snapshot (its chain non-empty), evicting the least recently used one when the pool is
    /// full: (its id, the evicted snapshot). None (nothing stored, the tail block not taken) when the pool
    /// has no room at all.
    pub fn insert(&mut self, snapshot: Snapshot) -> Option<(u32, Option<Dropped>)> {
        let mut freed = None;
        if self.pool.num_free() == 0 {
            let victim = self.lru.values().copied().find(|id| !self.pinned.contains(id))?;
            freed = Some(self.remove(victim));
        }
        let id = self.pool.allocate()?;
        self.by_last.entry(snapshot.key).or_default().push(id);
        for &hash in &snapshot.chain {
            self.dependents.entry(hash).or_default().push(id);
        }
        self.slab[id as usize] = Some(snapshot);
        self.touch(id);
        Some((id, freed))
    }

    /// Drops a snapshot (never a pinned one: the cache keeps a hit's chain, eviction skips pins).
    pub fn remove(&mut self, id: u32) -> Dropped {
        debug_assert!(!self.pinned.contains(&id), "a pinned snapshot is dropped");
        let snapshot = self.slab[id as usize].take().expect("a live snapshot");
        self.unlist_lru(id);
        self.pool.free(id).expect("a held snapshot");
        unlist(&mut self.by_last, snapshot.key, id);
        for &hash in &snapshot.chain {
            unlist(&mut self.dependents, hash, id);
        }
        Dropped { tail_block: snapshot.tail_block, worker_slot: self.worker_slot(id) }
    }

    /// Drops every snapshot whose chain holds `hash` (its block left the cache).
    pub fn drop_dependents(&mut self, hash: u64) -> Vec<Dropped> {
        let ids = self.dependents.get(&hash).cloned().unwrap_or_default();
        ids.into_iter().map(|id| self.remove(id)).collect()
    }

    /// Drops every snapshot (between steps: nothing is pinned).
    pub fn clear(&mut self) -> Vec<Dropped> {
        self.pinned.clear();
        let ids: Vec<u32> = (0..self.slab.len() as u32).filter(|&id| self.slab[id as usize].is_some()).collect();
        ids.into_iter().map(|id| self.remove(id)).collect()
    }

    /// The pool is conserved and every snapshot is listed under its chain.
    pub fn check(&self) -> Result<(), String> {
        let num_live = self.slab.iter().flatten().count() as u32;
        if num_live != self.pool.num_held() || self.lru.len() as u32 != num_live {
            return Err(format!(
                "{num_live} snapshots but {} snapshot slots held, {} in the LRU order",
                self.pool.num_held(),
                self.lru.len()
            ));
        }
        for (id, s) in self.slab.iter().enumerate().filter_map(|(i, s)| s.as_ref().map(|s| (i as u32, s))) {
            if self.pool.ref_count(id) != 1 || !self.by_last.get(&s.key).is_some_and(|v| v.contains(&id)) {
                return Err(format!("snapshot {id} is not held once or not listed under its chain"));
            }
        }
        Ok(())
    }
}

fn unlist(map: &mut HashMap<u64, Vec<u32>>, key: u64, id: u32) {
    if let Some(ids) = map.get_mut(&key) {
        ids.retain(|&x| x != id);
        if ids.is_empty() {
            map.remove(&key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap(chain: &[u64], tail: &[u32], tail_block: Option<u32>) -> Snapshot {
        let key = chain.last().copied().unwrap_or(ROOT);
        Snapshot { key, chain: chain.to_vec(), tail: tail.to_vec(), tail_block, ready_step: 0, at_end: true }
    }

    const ROOT: u64 = 99;

    #[test]
    fn the_deepest_matching_snapshot_wins() {
        let mut s = Snapshots::new(4, 9);
        let (a, _) = s.insert(snap(&[1], &[], None)).unwrap();
        let (b, _) = s.insert(snap(&[1, 2], &[5, 6], Some(3))).unwrap();
        s.insert(snap(&[1, 2], &[5, 7], Some(4))).unwrap();
        let tokens = [0, 0, 0, 0, 5, 6, 8];
        assert_eq!(s.find(ROOT, &[1, 2], 2, &tokens, 6, 2, 0, |_, _| true), Some((b, 6)));
        assert_eq!(s.find(ROOT, &[1, 2], 2, &tokens, 5, 2, 0, |_, _| true), Some((a, 2)));
        assert_eq!(s.find(ROOT, &[1, 2], 1, &tokens, 6, 2, 0, |_, _| true), Some((a, 2)));
        assert_eq!(s.find(ROOT, &[1, 2], 2, &tokens, 6, 2, 0, |_, _| false), Some((a, 2)));
        assert_eq!(s.worker_slot(a), 9);
        let tails: Vec<Option<u32>> = s.drop_dependents(2).iter().map(|d| d.tail_block).collect();
        assert_eq!(tails, vec![Some(3), Some(4)]);
        assert!(s.check().is_ok());
        assert_eq!(s.num_held(), 1);
        // A boundary inside the first block: keyed by the root.
        let (c, _) = s.insert(snap(&[], &[0, 0, 0], None)).unwrap();
        assert_eq!(s.find(ROOT, &[7], 0, &tokens, 6, 2, 0, |_, _| true), Some((c, 3)));
        assert_eq!(s.find(ROOT + 1, &[7], 0, &tokens, 6, 2, 0, |_, _| true), None);
    }

    #[test]
    fn a_full_pool_evicts_the_least_recently_used() {
        let mut s = Snapshots::new(2, 5);
        let (a, _) = s.insert(snap(&[1], &[], Some(7))).unwrap();
        let (b, _) = s.insert(snap(&[2], &[], Some(8))).unwrap();
        s.touch(a);
        let (c, freed) = s.insert(snap(&[3], &[], None)).unwrap();
        assert_eq!((c, freed), (b, Some(Dropped { tail_block: Some(8), worker_slot: 6 })));
        assert_eq!(s.find_exact(1, 1, &[]), Some(a));
        assert_eq!(s.find_exact(2, 1, &[]), None);
        assert_eq!(s.clear(), vec![Dropped { tail_block: Some(7), worker_slot: 5 }, Dropped { tail_block: None, worker_slot: 6 }]);
        assert!(s.check().is_ok());
    }
}
