//! A pool of fixed-size units (paged KV blocks, or per-request state slots) handed out from a free
//! list with reference counts. One type serves both pools.
//!
//! Invariants:
//! - id 0 is never handed out: it is the null block / null state slot that placeholder rows and
//!   padded block tables point at;
//! - an id is on the free list exactly when its reference count is 0;
//! - `num_free() + num_held() == num_total()` at all times;
//! - allocation takes the head of the free list, and an id whose count drops to 0 goes to the tail.

use std::collections::VecDeque;
use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolError {
    /// `free` or `incref` on an id that is not held.
    NotHeld { pool: &'static str, id: u32 },
    /// An id outside `1..num_ids`.
    OutOfRange { pool: &'static str, id: u32 },
}

impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolError::NotHeld { pool, id } => write!(f, "{pool} {id} is not held (double free?)"),
            PoolError::OutOfRange { pool, id } => write!(f, "{pool} {id} is out of range"),
        }
    }
}

#[derive(Debug, Clone)]
pub struct BlockManager {
    /// "block" or "state slot", for error messages.
    name: &'static str,
    free_list: VecDeque<u32>,
    /// Indexed by id; `ref_counts[0]` stays 0 forever.
    ref_counts: Vec<u32>,
}

impl BlockManager {
    /// A pool of `num_ids` ids, of which ids `1..num_ids` can be handed out.
    pub fn new(name: &'static str, num_ids: u32) -> Self {
        let num_ids = num_ids.max(1);
        BlockManager {
            name,
            free_list: (1..num_ids).collect(),
            ref_counts: vec![0; num_ids as usize],
        }
    }

    /// Ids that can ever be handed out (id 0 excluded).
    pub fn num_total(&self) -> u32 {
        self.ref_counts.len() as u32 - 1
    }

    pub fn num_free(&self) -> u32 {
        self.free_list.len() as u32
    }

    pub fn num_held(&self) -> u32 {
        self.num_total() - self.num_free()
    }

    /// Fraction of the pool held, in [0, 1].
    pub fn usage(&self) -> f64 {
        if self.num_total() == 0 {
            return 0.0;
        }
        self.num_held() as f64 / self.num_total() as f64
    }

    /// Takes the head of the free list with a reference count of 1; `None` when the pool is empty.
    pub fn allocate(&mut self) -> Option<u32> {
        let id = self.free_list.pop_front()?;
        self.ref_counts[id as usize] = 1;
        Some(id)
    }

    /// Allocates `n` ids, or none at all when fewer than `n` are free.
    pub fn allocate_many(&mut self, n: u32) -> Option<Vec<u32>> {
        if n > self.num_free() {
            return None;
        }
        Some((0..n).map(|_| self.allocate().expect("checked free count")).collect())
    }

    fn check(&self, id: u32) -> Result<(), PoolError> {
        if id == 0 || id as usize >= self.ref_counts.len() {
            return Err(PoolError::OutOfRange { pool: self.name, id });
        }
        if self.ref_counts[id as usize] == 0 {
            return Err(PoolError::NotHeld { pool: self.name, id });
        }
        Ok(())
    }

    /// Adds a holder to a held id (a fork sharing a full block).
    pub fn incref(&mut self, id: u32) -> Result<(), PoolError> {
        self.check(id)?;
        self.ref_counts[id as usize] += 1;
        Ok(())
    }

    /// Drops one holder; the id goes to the tail of the free list when none remain.
    pub fn free(&mut self, id: u32) -> Result<(), PoolError> {
        self.check(id)?;
        let count = &mut self.ref_counts[id as usize];
        *count -= 1;
        if *count == 0 {
            self.free_list.push_back(id);
        }
        Ok(())
    }

    pub fn ref_count(&self, id: u32) -> u32 {
        self.ref_counts.get(id as usize).copied().unwrap_or(0)
    }

    /// The free list, head first.
    pub fn free_ids(&self) -> Vec<u32> {
        self.free_list.iter().copied().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_zero_is_never_handed_out() {
        let mut pool = BlockManager::new("block", 4);
        assert_eq!(pool.num_total(), 3);
        let ids: Vec<u32> = std::iter::from_fn(|| pool.allocate()).collect();
        assert_eq!(ids, vec![1, 2, 3]);
        assert_eq!(pool.allocate(), None);
        assert!(pool.free(0).is_err());
    }

    #[test]
    fn head_allocation_tail_free_gives_the_drawer_table() {
        // The walkthrough's drawers: with 7 and 2 at the head of the free list, a 6-token prompt
        // in 4-token blocks gets the table [7, 2].
        let mut pool = BlockManager::new("block", 10);
        let all = pool.allocate_many(9).unwrap();
        assert_eq!(all, (1..10).collect::<Vec<_>>());
        for id in [7, 2, 5] {
            pool.free(id).unwrap();
        }
        assert_eq!(pool.allocate_many(2).unwrap(), vec![7, 2]);
        assert_eq!(pool.allocate(), Some(5));
    }

    #[test]
    fn reference_counts_free_only_at_zero() {
        let mut pool = BlockManager::new("block", 3);
        let id = pool.allocate().unwrap();
        pool.incref(id).unwrap();
        pool.free(id).unwrap();
        assert_eq!(pool.num_free(), 1);
        pool.free(id).unwrap();
        assert_eq!(pool.num_free(), 2);
        assert_eq!(pool.free_ids(), vec![2, 1]);
        assert_eq!(pool.free(id), Err(PoolError::NotHeld { pool: "block", id }));
    }

    #[test]
    fn allocate_many_is_all_or_nothing() {
        let mut pool = BlockManager::new("state slot", 3);
        assert_eq!(pool.allocate_many(3), None);
        assert_eq!(pool.num_free(), 2);
        assert_eq!(pool.allocate_many(2), Some(vec![1, 2]));
    }
}
