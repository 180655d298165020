//! The scheduler's one order of requests (docs/architecture.md, "The waiting queue's order").
//!
//! The waiting queue is kept sorted by `QueueOrder`, ascending: the first request is the next one
//! prefill scheduling looks at. Preemption takes running requests from the other end: the greatest
//! `QueueOrder` (the tenant with the most service, then the lowest priority, then the latest arrival)
//! is preempted first. Anything that reorders requests later (prefix-cache hits) extends this type,
//! and both the queue and preemption follow.
//!
//! Fairness across tenants (API keys, or clients of an open API) is a virtual-time scheme (start-time
//! fair queuing over tokens): each tenant with live requests has a count of the tokens the scheduler
//! has planned for it (`TenantShares`), and a tenant that had no live requests joins at the virtual
//! time: the least count among the live tenants when the last step was planned, before that step's
//! tokens were counted. So a newcomer neither starves the others with credit saved while idle nor
//! waits behind what they were served before it came: it goes ahead of a tenant whose prompt is in
//! service, and ties only with a tenant that was not served in the last step. A request's `share` is
//! its tenant's count; the queue is re-sorted when a step is planned, so the tenant served least goes
//! first.

use std::collections::HashMap;

/// A request's place in the order: compared field by field, smaller first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct QueueOrder {
    /// Tokens planned for the request's tenant while it has had live requests (`TenantShares`).
    pub share: u64,
    /// The request's priority: a lower value is served first (vLLM's convention); 0 by default.
    pub priority: i32,
    /// Order of arrival at this scheduler (a fork arrives when it is made).
    pub arrival: u64,
}

/// Where a request of order `key` goes in a queue sorted by `QueueOrder` (after its equals).
pub fn insertion_point(queue: impl Iterator<Item = QueueOrder>, key: QueueOrder) -> usize {
    queue.take_while(|&other| other <= key).count()
}

/// One tenant's account while it has live requests.
#[derive(Debug, Clone)]
struct TenantShare {
    /// The tenant's name (its key in `TenantShares::slots`).
    name: String,
    /// Live (waiting or running) requests of the tenant.
    num_live: u32,
    /// Tokens planned for the tenant (prompt chunks and decode rows), from its joining count on.
    num_served_tokens: u64,
}

/// The tenants with live requests and the service each has had: `QueueOrder::share`. A live tenant
/// has a slot, which its requests hold (`Request::tenant_slot`), so the queue's order reads a share
/// by index, never by hashing a name.
#[derive(Debug, Clone, Default)]
pub struct TenantShares {
    /// Live tenants' slots by name.
    slots: HashMap<String, usize>,
    /// Accounts by slot; None: a free slot (listed in `free_slots`).
    accounts: Vec<Option<TenantShare>>,
    free_slots: Vec<usize>,
    /// Where a tenant without live requests joins: the least count among the live tenants when the
    /// last step was planned, before its tokens were counted (`start_step`). Never decreases.
    virtual_time: u64,
}

impl TenantShares {
    /// A request of `tenant` goes live; returns the tenant's slot. A tenant without live requests
    /// joins at the virtual time.
    pub fn join(&mut self, tenant: &str) -> usize {
        if let Some(&slot) = self.slots.get(tenant) {
            self.account_mut(slot).num_live += 1;
            return slot;
        }
        let account = TenantShare { name: tenant.to_string(), num_live: 1, num_served_tokens: self.virtual_time };
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.accounts[slot] = Some(account);
                slot
            }
            None => {
                self.accounts.push(Some(account));
                self.accounts.len() - 1
            }
        };
        self.slots.insert(tenant.to_string(), slot);
        slot
    }

    /// A request of the tenant in `slot` finished or was aborted; the account goes with its last one.
    pub fn leave(&mut self, slot: usize) {
        let account = self.account_mut(slot);
        account.num_live -= 1;
        if account.num_live == 0 {
            let name = self.accounts[slot].take().expect("a live slot").name;
            self.slots.remove(&name);
            self.free_slots.push(slot);
        }
    }

    /// A step is being planned: the virtual time moves to the least count among the live tenants,
    /// before the step's tokens are counted (`serve`). Every live count is at least the virtual time
    /// (a joiner starts at it, counts only grow), so it never decreases.
    pub fn start_step(&mut self) {
        if let Some(least) = self.accounts.iter().flatten().map(|t| t.num_served_tokens).min() {
            self.virtual_time = least;
        }
    }

    /// Counts `num_tokens` planned for a request of the tenant in `slot`.
    pub fn serve(&mut self, slot: usize, num_tokens: u32) {
        self.account_mut(slot).num_served_tokens += num_tokens as u64;
    }

    /// The count of the tenant in `slot` (`QueueOrder::share`).
    pub fn share(&self, slot: usize) -> u64 {
        self.accounts[slot].as_ref().expect("a live request's tenant has an account").num_served_tokens
    }

    /// The slot of a live tenant, by name.
    pub fn slot(&self, tenant: &str) -> Option<usize> {
        self.slots.get(tenant).copied()
    }

    /// Tenants with live requests.
    pub fn num_tenants(&self) -> usize {
        self.slots.len()
    }

    /// Live requests over all tenants (checked against the scheduler's own count).
    pub fn num_live(&self) -> u32 {
        self.accounts.iter().flatten().map(|t| t.num_live).sum()
    }

    fn account_mut(&mut self, slot: usize) -> &mut TenantShare {
        self.accounts[slot].as_mut().expect("a live request's tenant has an account")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(share: u64, priority: i32, arrival: u64) -> QueueOrder {
        QueueOrder { share, priority, arrival }
    }

    #[test]
    fn share_then_priority_then_arrival() {
        let a = order(0, 0, 5);
        let b = order(0, -1, 9);
        let c = order(0, 0, 2);
        let d = order(1, -5, 0);
        let mut all = [a, b, c, d];
        all.sort();
        assert_eq!(all, [b, c, a, d]);
        assert_eq!(insertion_point(all.iter().copied(), order(0, 0, 3)), 2);
        assert_eq!(insertion_point(all.iter().copied(), order(0, 1, 0)), 3);
        assert_eq!(insertion_point(all.iter().copied(), order(2, -9, 0)), 4);
    }

    #[test]
    fn a_tenant_joins_at_the_virtual_time_and_its_account_goes_with_its_last_request() {
        let mut shares = TenantShares::default();
        let heavy = shares.join("heavy");
        let other = shares.join("other");
        shares.start_step();
        shares.serve(heavy, 256);
        shares.serve(other, 100);
        shares.start_step();
        shares.serve(heavy, 50);
        // At the least live count before the last step's tokens (100), not at 0: saved credit would
        // starve the others; nor at after them: it would wait behind the step in service.
        let new = shares.join("new");
        assert_eq!(shares.share(new), 100);
        shares.serve(other, 30);
        shares.leave(new);
        shares.start_step();
        let new = shares.join("new");
        assert_eq!(shares.share(new), 130);
        assert_eq!(shares.join("heavy"), heavy);
        assert_eq!((shares.share(heavy), shares.num_live(), shares.num_tenants()), (306, 4, 3));
        shares.leave(heavy);
        assert_eq!(shares.share(heavy), 306);
        shares.leave(heavy);
        shares.leave(other);
        shares.leave(new);
        assert_eq!((shares.num_tenants(), shares.num_live(), shares.slot("heavy")), (0, 0, None));
        // A tenant that comes back with nobody else live starts at the virtual time, which never
        // goes back, in a freed slot.
        shares.start_step();
        let back = shares.join("heavy");
        assert!(back < 3);
        assert_eq!(shares.share(back), 130);
    }
}
