"""Random add / schedule / update / abort / fork sequences on small pools, so preemption and chunked
prefill happen often, in separate and in mixed steps, with random priorities and tenants, and with prefix
caching (prompts sharing prefixes, blocks evicted under pressure, snapshots dropped with them, the cache
dropped now and then). After every step: pool conservation and reference counts, the waiting queue in its
order (tenant share, priority, arrival), and every live request in its tenant's account (check_invariants);
every plan within the token budget (a mixed one: decode rows first); at the end: every added request has
exactly one final output and every block is back once the prefix cache is dropped. Synchronous steps without
drafts also run on a symbolic worker (each block position and state slot holds the tokens that wrote it; plan
copies move them): every row's request finds, in its blocks and state slot, exactly its own tokens before the
row (so a cache hit restores the right state, and no copy or reuse clobbers a block or slot still needed)."""

from collections import Counter

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler_rs import PreemptionMode, Scheduler, SchedulerConfig, Scheduling, StepResult
from services.engine.prefix.block_hash import block_hashes, root_hash

EOS = 1
VOCAB = 16


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        nextn=st.sampled_from([0, 0, 2]),
        recompute=st.booleans(),
        max_inflight=st.sampled_from([1, 2]),
        num_blocks=st.integers(4, 10),
        mixed=st.booleans(),
        prefix=st.booleans(),
    )
    def setup(self, nextn, recompute, max_inflight, num_blocks, mixed, prefix):
        mode = PreemptionMode.RECOMPUTE if recompute else PreemptionMode.STOP
        # Mixed steps hold every decode row (3 requests × (1 + nextn)) and chunk prompts in what is left.
        self.config = SchedulerConfig(
            block_size=4,
            num_blocks=num_blocks,
            num_state_slots=4,
            max_num_seqs=3,
            max_num_batched_tokens=3 * (1 + nextn) + 4 if mixed else 6,
            max_model_len=40,
            nextn=nextn,
            preemption_mode=mode,
            vocab_size=VOCAB,
            compress_ratios=[2, 1],
            scheduling=Scheduling.MIXED if mixed else Scheduling.SEPARATE,
            enable_prefix_caching=prefix,
            num_state_snapshots=2,
        )
        self.scheduler = Scheduler(self.config)
        self.max_inflight = max_inflight
        self.inflight = []
        self.added = []
        self.finals = Counter()
        self.next_id = 0
        self.hashes: dict[str, list[int]] = {}  # per request: the hashes given to the scheduler
        # The symbolic worker (synchronous steps without drafts): per block, the token each position holds;
        # per state slot (snapshots included), the tokens it has seen.
        self.symbolic = max_inflight == 1 and nextn == 0
        self.blocks = [[None] * 4 for _ in range(num_blocks)]
        self.slots: list[list[int]] = [[] for _ in range(4 + 2)]

    def _execute(self, plan):
        """Runs ``plan`` on the symbolic worker: copies first (a placeholder plan's too, as the runner does), then
        each request's rows, after checking that its blocks and slot hold its tokens before its first row."""
        for src, dst in plan.block_copies:
            self.blocks[dst] = list(self.blocks[src])
        for src, dst in plan.state_copies:
            self.slots[dst] = list(self.slots[src])
        width = plan.block_table_width
        tables, starts = plan.block_tables.tolist(), plan.query_start.tolist()
        inputs, positions, slots = plan.input_ids.tolist(), plan.positions.tolist(), plan.state_slots.tolist()
        for i, request_id in enumerate(plan.request_ids):
            table = tables[i * width : (i + 1) * width]
            tokens = self.scheduler.request(request_id).token_ids
            first = positions[starts[i]]
            slot = self.slots[slots[i]]
            assert slot[:first] == tokens[:first] and len(slot) >= first, (request_id, "state slot", first)
            held = [self.blocks[table[q // 4]][q % 4] for q in range(first)]
            assert held == tokens[:first], (request_id, "blocks", first)
            self.slots[slots[i]] = slot[:first] + inputs[starts[i] : starts[i + 1]]
            for row in range(starts[i], starts[i + 1]):
                self.blocks[table[positions[row] // 4]][positions[row] % 4] = inputs[row]

    def _hash_new_blocks(self):
        """The engine's part: the hashes of blocks that requests' outputs filled."""
        for request_id, known in self.hashes.items():
            state = self.scheduler.request(request_id)
            if state is None:
                continue
            parent = known[-1] if known else None
            new = block_hashes(state.token_ids, 4, model="m", parent=parent, first_block=len(known))
            if new:
                self.scheduler.add_block_hashes(request_id, new)
                known.extend(new)

    def _record(self, outputs):
        for output in outputs:
            if output.finish_reason is not None:
                self.finals[output.request_id] += 1

    @rule(
        prompt_len=st.integers(1, 14),
        max_tokens=st.integers(1, 24),
        schedulable=st.sampled_from([True, True, False]),
        priority=st.sampled_from([0, 0, -1, 2]),
        tenant=st.sampled_from(["", "a", "b"]),
        fork_at=st.sampled_from([14, 14, 9, 5, 0]),
    )
    def add(self, prompt_len, max_tokens, schedulable, priority, tenant, fork_at):
        request_id = f"r{self.next_id}"
        self.next_id += 1
        try:
            prompt = [2 + i % 10 if i < fork_at else 12 + i % 3 for i in range(prompt_len)]  # shared prefixes
            self.scheduler.add_request(
                request_id,
                prompt,
                max_tokens=max_tokens,
                eos_token_id=EOS,
                schedulable=schedulable,
                priority=priority,
                tenant=tenant,
            )
        except ValueError as err:
            assert "blocks but the pool has" in str(err)
            return
        self.added.append(request_id)
        self.hashes[request_id] = block_hashes(prompt, 4, model="m")
        self.scheduler.set_block_hashes(request_id, root_hash("m"), self.hashes[request_id])

    @rule(data=st.data())
    def make_schedulable(self, data):
        if self.added:
            request_id = data.draw(st.sampled_from(self.added))
            if self.scheduler.request(request_id) is not None:
                self.scheduler.set_schedulable(request_id)

    @precondition(lambda self: len(self.inflight) < self.max_inflight)
    @rule()
    def schedule(self):
        plan = self.scheduler.schedule()
        self._record(plan.outputs)
        if plan.outputs:
            event("preempted")
        num_decode = plan.num_decode_requests
        if 0 in plan.num_sample_rows.tolist()[num_decode:]:
            event("prompt cut")
        if plan.kind == "mixed":
            event("mixed step")
        assert plan.num_rows <= self.config.max_num_batched_tokens or plan.kind == "decode"
        if self.symbolic:
            self._execute(plan)  # a placeholder plan's copies run too
        expected = {"decode": (plan.num_requests,), "prefill": (0,), "mixed": range(1, plan.num_requests)}
        assert num_decode in expected[plan.kind]
        if self.scheduler.stats().num_deferred_blocks:
            event("deferred free")
        self.inflight.append(plan)

    @precondition(lambda self: len(self.inflight) < self.max_inflight)
    @rule(data=st.data(), num_steps=st.integers(1, 6))
    def steps(self, data, num_steps):
        for _ in range(num_steps):
            self.schedule()
            self.update(data)

    @precondition(lambda self: self.inflight)
    @rule(data=st.data())
    def update(self, data):
        plan = self.inflight.pop(0)
        num_tokens, tokens, errors = [], [], []
        for i, n in enumerate(plan.num_sample_rows.tolist()):
            if data.draw(st.integers(0, 30)) == 0:
                errors.append(i)
                num_tokens.append(0)
                continue
            count = n if i >= plan.num_decode_requests else data.draw(st.integers(1, n))
            num_tokens.append(count)
            tokens += [data.draw(st.integers(0, VOCAB - 1)) for _ in range(count)]
        drafts = [self.config.nextn] * plan.num_requests if self.config.nextn else None
        draft_ids = [3] * (self.config.nextn * plan.num_requests) if self.config.nextn else None
        self._record(self.scheduler.update(plan, StepResult(num_tokens, tokens, drafts, draft_ids, errors)))
        self._hash_new_blocks()
        if self.scheduler.stats().num_state_snapshots:
            event("snapshot held")
        if self.scheduler.stats().prefix_cache_hits:
            event("prefix cache hit")

    @rule(data=st.data())
    def clear_prefix_cache(self, data):
        if data.draw(st.integers(0, 9)) == 0:  # rarely, so hits happen
            self.scheduler.clear_prefix_cache()

    @rule(data=st.data())
    def abort(self, data):
        if self.added:
            request_id = data.draw(st.sampled_from(self.added))
            final = self.scheduler.abort(request_id)
            if final is not None:
                assert final.finish_reason.value == "abort"
                self._record([final])

    @rule(data=st.data())
    def fork(self, data):
        if not self.added:
            return
        parent = data.draw(st.sampled_from(self.added))
        state = self.scheduler.request(parent)
        if state is None or state.status != "running" or self.inflight:
            return
        child = f"r{self.next_id}"
        self.next_id += 1
        try:
            self.scheduler.fork(parent, child, max_tokens=4, eos_token_id=EOS)
        except RuntimeError as err:
            assert "not enough free" in str(err)
            return
        self.added.append(child)
        self.hashes[child] = list(self.hashes[parent])

    @invariant()
    def pools_are_conserved(self):
        self.scheduler.check_invariants()

    @invariant()
    def at_most_one_final_output(self):
        assert all(count == 1 for count in self.finals.values()), self.finals

    def teardown(self):
        # Drain: abort what is left, update what is in flight; nothing may be lost or leaked.
        for request_id in self.added:
            final = self.scheduler.abort(request_id)
            if final is not None:
                self._record([final])
        while self.inflight:
            plan = self.inflight.pop(0)
            result = StepResult([0] * plan.num_requests, [], errors=list(range(plan.num_requests)))
            self._record(self.scheduler.update(plan, result))
        self.scheduler.check_invariants()
        self.scheduler.clear_prefix_cache()
        self.scheduler.check_invariants()
        assert self.finals == Counter(self.added)
        stats = self.scheduler.stats()
        assert stats.num_free_blocks == stats.num_total_blocks
        assert stats.num_free_state_slots == stats.num_total_state_slots


TestSchedulerProperties = SchedulerMachine.TestCase
TestSchedulerProperties.settings = settings(
    max_examples=1000, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)
