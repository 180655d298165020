//! The scheduler's one order of requests (docs/architecture.md, "The waiting queue's order").
//!
//! The waiting queue is kept sorted by `QueueOrder`, ascending: the first request is the next one
//! prefill scheduling looks at. Preemption takes running requests from the other end: the greatest
//! `QueueOrder` (the lowest priority, then the latest arrival) is preempted first. Anything that
//! reorders requests later (fairness across API keys, prefix-cache hits) extends this type, and both
//! the queue and preemption follow.

/// A request's place in the order: compared field by field, smaller first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct QueueOrder {
    /// The request's priority: a lower value is served first (vLLM's convention); 0 by default.
    pub priority: i32,
    /// Order of arrival at this scheduler (a fork arrives when it is made).
    pub arrival: u64,
}

/// Where a request of order `key` goes in a queue sorted by `QueueOrder` (after its equals).
pub fn insertion_point(queue: impl Iterator<Item = QueueOrder>, key: QueueOrder) -> usize {
    queue.take_while(|&other| other <= key).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priority_then_arrival() {
        let a = QueueOrder { priority: 0, arrival: 5 };
        let b = QueueOrder { priority: -1, arrival: 9 };
        let c = QueueOrder { priority: 0, arrival: 2 };
        let mut all = [a, b, c];
        all.sort();
        assert_eq!(all, [b, c, a]);
        assert_eq!(insertion_point(all.iter().copied(), QueueOrder { priority: 0, arrival: 3 }), 2);
        assert_eq!(insertion_point(all.iter().copied(), QueueOrder { priority: 1, arrival: 0 }), 3);
    }
}
