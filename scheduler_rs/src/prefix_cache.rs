//! The prefix cache's blocks: full paged blocks named by the hash of their content and of every block
//! before them (`services/engine/prefix/block_hash.py`), shared read-only by every request whose prompt
//! (or output) has that chain, and kept after their requests end until evicted.
//!
//! The cache holds one reference on each cached block, so a block is freed only when no request and
//! not the cache names it. A cached block that only the cache holds is evictable; eviction takes the
//! least recently released first (a request releases its blocks deepest first, so a chain is cut from its
//! tail). Events (hashes stored and removed since the last `take_events`) are kept net of the window.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::block_manager::BlockManager;

/// The blocks that entered and left the cache since the last `PrefixCache::take_events`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvEvents {
    /// Hashes of blocks that entered the cache, oldest first.
    pub stored: Vec<u64>,
    /// Hashes of blocks that left the cache, oldest first.
    pub removed: Vec<u64>,
    /// The whole cache was dropped before these events.
    pub cleared: bool,
}

#[derive(Debug, Clone, Default)]
pub struct PrefixCache {
    by_hash: HashMap<u64, u32>,
    hash_of: HashMap<u32, u64>,
    /// Cached blocks that only the cache holds, by the tick of their release: the eviction order.
    evictable: BTreeMap<u64, u32>,
    evictable_tick: HashMap<u32, u64>,
    next_tick: u64,
    events: KvEvents,
    /// Hashes in `events.stored`, so an eviction in the same window cancels the store.
    stored_now: HashSet<u64>,
}

impl PrefixCache {
    /// The cached block of `hash`, if any.
    pub fn get(&self, hash: u64) -> Option<u32> {
        self.by_hash.get(&hash).copied()
    }

    /// How many of `hashes`, from the first, are cached.
    pub fn num_cached(&self, hashes: &[u64]) -> usize {
        hashes.iter().take_while(|h| self.by_hash.contains_key(h)).count()
    }

    pub fn num_blocks(&self) -> u32 {
        self.by_hash.len() as u32
    }

    pub fn num_evictable(&self) -> u32 {
        self.evictable.len() as u32
    }

    /// The blocks the cache holds a reference on.
    pub fn blocks(&self) -> impl Iterator<Item = u32> + '_ {
        self.by_hash.values().copied()
    }

    /// Caches `block` (held by a request, computed) as `hash`. False (nothing done) when the hash is
    /// already cached, by this block or another one computed at the same time.
    pub fn insert(&mut self, hash: u64, block: u32, blocks: &mut BlockManager) -> bool {
        if self.by_hash.contains_key(&hash) || self.hash_of.contains_key(&block) {
            return false;
        }
        blocks.incref(block).expect("a request holds the block it caches");
        self.by_hash.insert(hash, block);
        self.hash_of.insert(block, hash);
        self.events.stored.push(hash);
        self.stored_now.insert(hash);
        true
    }

    /// A request takes a cached block (a hit): one more reference, and it is no longer evictable.
    pub fn acquire(&mut self, block: u32, blocks: &mut BlockManager) {
        blocks.incref(block).expect("a cached block is held by the cache");
        if let Some(tick) = self.evictable_tick.remove(&block) {
            self.evictable.remove(&tick);
        }
    }

    /// Called after a holder let go of `block`: a cached block that only the cache holds now becomes
    /// the most recently released evictable block.
    pub fn released(&mut self, block: u32, blocks: &BlockManager) {
        if blocks.ref_count(block) == 1 && self.hash_of.contains_key(&block) && !self.evictable_tick.contains_key(&block)
        {
            let tick = self.next_tick;
            self.next_tick += 1;
            self.evictable.insert(tick, block);
            self.evictable_tick.insert(block, tick);
        }
    }

    /// Evicts the least recently released evictable block to the free list; its hash, or None when
    /// no block is evictable.
    pub fn evict_one(&mut self, blocks: &mut BlockManager) -> Option<u64> {
        let (_, block) = self.evictable.pop_first()?;
        self.evictable_tick.remove(&block);
        let hash = self.hash_of.remove(&block).expect("an evictable block is cached");
        self.by_hash.remove(&hash);
        blocks.free(block).expect("the cache holds its blocks");
        if self.stored_now.remove(&hash) {
            self.events.stored.retain(|&h| h != hash);
        } else {
            self.events.removed.push(hash);
        }
        Some(hash)
    }

    /// Drops the cache's reference on every cached block (requests keep theirs).
    pub fn clear(&mut self, blocks: &mut BlockManager) {
        for (_, block) in self.by_hash.drain() {
            blocks.free(block).expect("the cache holds its blocks");
        }
        self.hash_of.clear();
        self.evictable.clear();
        self.evictable_tick.clear();
        self.stored_now.clear();
        self.events = KvEvents { cleared: true, ..KvEvents::default() };
    }

    /// The events since the last call.
    pub fn take_events(&mut self) -> KvEvents {
        self.stored_now.clear();
        std::mem::take(&mut self.events)
    }

    /// Whether every evictable block is cached and held by the cache alone.
    pub fn check(&self, blocks: &BlockManager) -> Result<(), String> {
        for &block in self.evictable.values() {
            if blocks.ref_count(block) != 1 || !self.hash_of.contains_key(&block) {
                return Err(format!("evictable block {block} is held by a request or not cached"));
            }
        }
        for (&block, &hash) in &self.hash_of {
            if self.by_hash.get(&hash) != Some(&block) {
                return Err(format!("cached block {block} is not under its hash"));
            }
            if blocks.ref_count(block) == 1 && !self.evictable_tick.contains_key(&block) {
                return Err(format!("cached block {block} is held by the cache alone but not evictable"));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_released_block_is_evicted_lru_and_reported_once() {
        let mut pool = BlockManager::new("block", 4);
        let mut cache = PrefixCache::default();
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        assert!(cache.insert(10, a, &mut pool));
        assert!(cache.insert(11, b, &mut pool));
        assert!(!cache.insert(10, b, &mut pool));
        assert_eq!(cache.take_events().stored, vec![10, 11]);
        for block in [b, a] {
            pool.free(block).unwrap();
            cache.released(block, &pool);
        }
        assert_eq!(cache.num_evictable(), 2);
        assert_eq!(cache.evict_one(&mut pool), Some(11));
        cache.acquire(a, &mut pool);
        assert_eq!(cache.evict_one(&mut pool), None);
        assert_eq!(cache.take_events(), KvEvents { stored: vec![], removed: vec![11], cleared: false });
        assert!(cache.check(&pool).is_ok());
        pool.free(a).unwrap();
        cache.clear(&mut pool);
        assert_eq!(pool.num_free(), 3);
    }

    #[test]
    fn a_store_evicted_in_the_same_window_is_not_reported() {
        let mut pool = BlockManager::new("block", 3);
        let mut cache = PrefixCache::default();
        let a = pool.allocate().unwrap();
        cache.insert(7, a, &mut pool);
        pool.free(a).unwrap();
        cache.released(a, &pool);
        assert_eq!(cache.evict_one(&mut pool), Some(7));
        assert_eq!(cache.take_events(), KvEvents::default());
    }
}
