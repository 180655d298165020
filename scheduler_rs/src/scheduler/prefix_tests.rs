use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use super::*;
use crate::config::TEST_LIMITS;
use crate::step::StepResult;

fn config(num_blocks: u32) -> SchedulerConfig {
    let mut config = SchedulerConfig::new(1, TEST_LIMITS);
    config.block_size = 4;
    config.num_blocks = num_blocks;
    config.num_state_slots = 8;
    config.compress_ratios = vec![1];
    config.enable_prefix_caching = true;
    config.num_state_snapshots = 4;
    config
}

/// A stand-in for `block_hash.py`'s chain: full blocks of 4 tokens.
fn hashes(tokens: &[u32]) -> Vec<u64> {
    let mut prev = 0u64;
    tokens
        .chunks_exact(4)
        .map(|block| {
            let mut h = DefaultHasher::new();
            (prev, block).hash(&mut h);
            prev = h.finish();
            prev
        })
        .collect()
}

fn add(s: &mut Scheduler, id: &str, prompt: Vec<u32>, max_tokens: u32) {
    let h = hashes(&prompt);
    s.add_request(id.into(), prompt, StopRules::new(max_tokens), true, false, 0, String::new()).unwrap();
    s.set_block_hashes(id, 0, h, Vec::new(), true).unwrap();
}

/// One step; every sampled row yields `7`; then the engine's part: hashes of newly filled blocks.
fn step(s: &mut Scheduler) -> StepPlan {
    let plan = s.schedule(&mut SingleRank);
    let mut result = StepResult::default();
    for i in 0..plan.num_requests() {
        let n = plan.num_sample_rows[i] as u32;
        result.num_tokens.push(n);
        result.token_ids.extend(std::iter::repeat_n(7, n as usize));
    }
    s.update(&plan, &result).unwrap();
    let ids: Vec<String> = s.ids.keys().cloned().collect();
    for id in ids {
        let req = s.request(&id).unwrap();
        let all = hashes(&req.tokens);
        let new = all[req.block_hashes.len()..].to_vec();
        s.add_block_hashes(&id, &new).unwrap();
    }
    s.check_invariants().unwrap();
    plan
}

fn run(s: &mut Scheduler) -> Vec<StepPlan> {
    let mut plans = Vec::new();
    while s.has_unfinished() {
        plans.push(step(s));
    }
    plans
}

fn prompt_rows(plans: &[StepPlan]) -> u32 {
    plans.iter().flat_map(|p| (p.num_decode_requests as usize..p.num_requests()).map(|i| p.seqlens_q[i] as u32)).sum()
}

#[test]
fn a_second_turn_resumes_after_the_first_answer() {
    let mut s = Scheduler::new(config(64)).unwrap();
    let turn1: Vec<u32> = (1..=10).collect();
    add(&mut s, "t1", turn1.clone(), 3);
    assert_eq!(prompt_rows(&run(&mut s)), 10);
    // The answer's last token has no KV: the finish snapshot is after 12 positions (3 full blocks).
    let mut turn2 = turn1;
    turn2.extend([7, 7, 7, 20, 21, 22, 23]);
    add(&mut s, "t2", turn2, 2);
    let plans = run(&mut s);
    assert_eq!(prompt_rows(&plans), 17 - 12);
    // The first step copies the first turn's finish snapshot out (planned when it ended), then into t2.
    let copies = &plans[0].state_copies;
    assert_eq!(copies.len(), 2);
    assert_eq!(copies[0].1, copies[1].0);
    assert!(copies[1].0 >= 8, "snapshot slots follow the 8 request slots");
    assert_eq!((s.stats().prefix_cache_queries, s.stats().prefix_cache_hits), (27, 12));
    s.clear_prefix_cache();
    assert_eq!(s.block_manager().num_free(), 63);
    assert_eq!(s.stats().num_state_snapshots, 0);
}

#[test]
fn a_prompt_end_with_a_tail_restores_its_partial_block() {
    let mut s = Scheduler::new(config(64)).unwrap();
    let prompt: Vec<u32> = (1..=10).collect();
    add(&mut s, "a", prompt.clone(), 1);
    run(&mut s);
    // "a" ended at once: its finish snapshot equals its prompt-end one (10 positions, tail of 2). (Its prompt's
    // last full block has none: a fresh prompt in one chunk is not cut there.)
    assert_eq!(s.stats().num_state_snapshots, 1);
    let mut longer = prompt;
    longer.extend([30, 31, 32]);
    add(&mut s, "b", longer, 1);
    let plans = run(&mut s);
    assert_eq!(prompt_rows(&plans), 3);
    // The prompt-end save's copy of the partial block (planned with a's step), then its restore into b.
    let copies = &plans[0].block_copies;
    assert_eq!(copies.len(), 2);
    assert_eq!(copies[0].1, copies[1].0);
}

#[test]
fn a_resent_prompt_is_cut_and_snapshotted_at_its_last_full_block() {
    let mut s = Scheduler::new(config(64)).unwrap();
    let system: Vec<u32> = (1..=4).collect();
    let mut prompt = system.clone();
    prompt.extend(5..=10);
    add(&mut s, "a", prompt.clone(), 1);
    let plans = run(&mut s);
    // A fresh prompt in one chunk is not cut: its first token comes one step after it is queued.
    assert_eq!(plans[0].seqlens_q, vec![10]);
    let mut resent = prompt.clone();
    resent[9] = 11;
    add(&mut s, "b", resent.clone(), 1);
    let plans = run(&mut s);
    // b shares a's cached blocks (it is resent traffic): cut at its last full block (8), snapshotted there.
    assert_eq!(plans[0].seqlens_q, vec![8]);
    assert_eq!(plans[1].seqlens_q, vec![2]);
    // A prompt that shares b's first 9 tokens (a chat history re-rendered differently at its end) resumes at 8.
    let mut other = resent[..9].to_vec();
    other.extend([40, 41]);
    add(&mut s, "c", other, 1);
    assert_eq!(prompt_rows(&run(&mut s)), 3);
}

#[test]
fn prompts_sharing_a_first_block_compute_it_once_and_are_cut_unless_they_extend_an_earlier_end() {
    let mut s = Scheduler::new(config(64)).unwrap();
    // Two fresh prompts queued together with the same first block (agents sharing a system prompt): the first
    // cuts a chunk where they diverge (4) and snapshots there while the second waits; then the second resumes
    // there. Each is resent traffic, cut at its last full block (8).
    let system: Vec<u32> = (1..=4).collect();
    let (mut a, mut b) = (system.clone(), system.clone());
    a.extend([10, 11, 12, 13, 14, 15]);
    b.extend([20, 21, 22, 23, 24, 25]);
    add(&mut s, "a", a.clone(), 1);
    add(&mut s, "b", b, 1);
    let plans = run(&mut s);
    let rows: Vec<Vec<i32>> = plans.iter().map(|p| p.seqlens_q.clone()).collect();
    assert_eq!(rows[..3], [vec![4], vec![4, 4], vec![2, 2]]);
    assert_eq!(prompt_rows(&plans), 10 + 6);
    // A next turn extending a's whole sequence resumes at a's finish snapshot (10 positions: its one output
    // has no KV) and is not cut at its last full block (12): its own end serves the turn after it.
    let mut turn2 = a;
    turn2.extend([7, 30, 31, 32, 33]);
    add(&mut s, "t2", turn2, 1);
    let plans = run(&mut s);
    assert_eq!(plans[0].seqlens_q, vec![5]);
}

#[test]
fn a_fresh_prompt_is_cut_at_its_last_full_block_only_where_that_costs_no_step() {
    let mut config = config(64);
    config.max_num_batched_tokens = 10;
    let mut s = Scheduler::new(config).unwrap();
    let chunks = |plans: &[StepPlan]| plans.iter().map(|p| p.seqlens_q[0]).collect::<Vec<_>>();
    // 8 tokens fit one step: not cut at 4 (that would add a step); snapshotted at its end only.
    add(&mut s, "a", (1..=8).collect(), 1);
    assert_eq!(chunks(&run(&mut s)), vec![8]);
    assert_eq!(s.stats().num_state_snapshots, 1);
    // 11 tokens take two steps either way: the first chunk is cut at the last full block (8), not at 10.
    add(&mut s, "b", (101..=111).collect(), 1);
    assert_eq!(chunks(&run(&mut s)), vec![8, 3]);
    assert_eq!(s.stats().num_state_snapshots, 3);
    // 14 tokens: the last full block (12) is past the first chunk, and the second reaches the end: no cut.
    add(&mut s, "c", (201..=214).collect(), 1);
    assert_eq!(chunks(&run(&mut s)), vec![10, 4]);
    assert_eq!(s.stats().num_state_snapshots, 4);
}

#[test]
fn agents_compute_only_the_suffix_from_the_third_request() {
    let mut s = Scheduler::new(config(64)).unwrap();
    let system: Vec<u32> = (1..=16).collect();
    let mut computed = Vec::new();
    for k in 0..4u32 {
        let mut prompt = system.clone();
        prompt.extend([100 + k, 200 + k, 300, 301, 302, 303]);
        add(&mut s, &format!("r{k}"), prompt, 2);
        computed.push(prompt_rows(&run(&mut s)));
    }
    // The second request finds the system prompt's blocks cached but no snapshot: it cuts a chunk
    // there and snapshots; later ones resume at that divergence point.
    assert_eq!(computed, vec![22, 22, 6, 6]);
}

#[test]
fn agents_queued_together_compute_the_system_prompt_once() {
    let mut config = config(64);
    config.max_num_batched_tokens = 8;
    let mut s = Scheduler::new(config).unwrap();
    let system: Vec<u32> = (1..=16).collect();
    for k in 0..4u32 {
        let mut prompt = system.clone();
        prompt.extend([100 + k, 200 + k, 300, 301, 302, 303]);
        add(&mut s, &format!("r{k}"), prompt, 2);
    }
    let plans = run(&mut s);
    // r0 computes the system prompt in two chunks of the budget and snapshots at its end (16), where the others
    // diverge from it; they wait for that snapshot, then compute their suffixes only.
    assert_eq!(plans[0].seqlens_q, vec![8]);
    assert_eq!(plans[1].seqlens_q, vec![8]);
    assert_eq!(prompt_rows(&plans), 22 + 3 * 6);
    assert_eq!(s.stats().prefix_cache_hits, 3 * 16);
    s.clear_prefix_cache();
    assert_eq!((s.block_manager().num_free(), s.stats().num_state_snapshots), (63, 0));
}

#[test]
fn a_prompt_waiting_for_a_shared_prefix_goes_on_when_its_computer_is_aborted() {
    let mut config = config(64);
    config.max_num_batched_tokens = 8;
    let mut s = Scheduler::new(config).unwrap();
    let system: Vec<u32> = (1..=16).collect();
    let (mut a, mut b) = (system.clone(), system.clone());
    a.extend([10, 11]);
    b.extend([20, 21]);
    add(&mut s, "a", a, 2);
    add(&mut s, "b", b, 2);
    assert_eq!(step(&mut s).seqlens_q, vec![8]);
    s.abort("a").unwrap();
    // No request will snapshot b's prefix any more: b starts at once, from the beginning.
    assert_eq!(step(&mut s).seqlens_q, vec![8]);
    assert_eq!(prompt_rows(&run(&mut s)), 10);
}

#[test]
fn eviction_under_pressure_drops_snapshots_and_keeps_pools_whole() {
    let mut s = Scheduler::new(config(12)).unwrap();
    for k in 0..6u32 {
        let prompt: Vec<u32> = (0..14).map(|t| t + 100 * k).collect();
        add(&mut s, &format!("r{k}"), prompt, 3);
        run(&mut s);
        assert_eq!(s.stats().num_free_blocks, 11, "cached blocks and snapshots' tail blocks count as free");
    }
    assert!(s.stats().num_cached_blocks <= 11);
    s.clear_prefix_cache();
    assert_eq!((s.block_manager().num_free(), s.stats().num_state_snapshots), (11, 0));
    assert!(s.take_kv_events().cleared);
}
