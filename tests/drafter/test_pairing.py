"""The EAGLE pairing: feature f_t goes with token x_{t+1} and predicts token x_{t+2}.

An oracle drafter that knows the sequence returns f_{t+1} only when it is handed exactly
(x_{t+1}, f_t); any off-by-one in the training indices (inputs, self-fed features, labels)
drops its accuracy to ~0. With the right pairing it is perfect at every TTT step.
"""

from __future__ import annotations

import torch

from tlt.drafter.eagle import DrafterConfig, EagleDrafter
from tlt.drafter.packing import FeatureSample, pack, pad
from tlt.drafter.ttt import TTTConfig, ttt_forward
from tests.drafter.test_packing import tiny_target_cfg

V, H = 20, 32


def _sequence(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (n,), generator=g)
    f = torch.zeros(n, H)
    f[:, 0] = 100 * seed + torch.arange(n).float()  # position code, unique across samples
    nxt = torch.cat([x[1:], x[:1]])
    f[torch.arange(n), 1 + nxt] = 10.0  # the target at t predicts x_{t+1}
    return x, f


class Oracle(EagleDrafter):
    def bind(self, samples):
        """(x_{t+1}, code of f_t) -> f_{t+1} for every position of every sample."""
        self.table = {(int(s.input_ids[t + 1]), round(float(s.hidden[t, 0]))): s.hidden[t + 1]
                      for s in samples for t in range(len(s) - 1)}

    def forward(self, input_ids, feature, position_ids, backend):
        out = torch.zeros(*input_ids.shape, H)
        for b in range(input_ids.shape[0]):
            for i in range(input_ids.shape[1]):
                hit = self.table.get((int(input_ids[b, i]), round(float(feature[b, i, 0].detach()))))
                if hit is not None:
                    out[b, i] = hit
        return out + 0 * self.fc.weight.sum()


def _head():
    head = torch.zeros(V, H)
    head[torch.arange(V), 1 + torch.arange(V)] = 1.0
    return head


class ShiftedOracle(Oracle):
    """Wrong pairing (f_t with x_t): must fail, or the test above proves nothing."""

    def bind(self, samples):
        self.table = {(int(s.input_ids[t]), round(float(s.hidden[t, 0]))): s.hidden[t + 1]
                      for s in samples for t in range(len(s) - 1)}


def test_oracle_with_eagle_pairing_is_perfect_at_every_step():
    tcfg = tiny_target_cfg(vocab_size=V, hidden_size=H)
    head = _head()
    samples = []
    for k, n in enumerate((9, 14)):
        x, f = _sequence(n, k)
        samples.append(FeatureSample(x, torch.arange(n) >= 2, f))
    d = Oracle(DrafterConfig.for_target(tcfg, "eagle"), torch.zeros(V, H), head)
    d.bind(samples)
    cfg = TTTConfig(steps=3)
    for batch in (pack(samples), pad(samples)):
        st = ttt_forward(d, batch, cfg)
        for j in range(3):
            assert st.count[j] > 0
            assert st.accuracy(j) == 1.0, (j, st.top1, st.count)
        # The chain accepts every draft unless it runs off the end of the sequence.
        assert st.accept_length > 1 + 2.0
    wrong = ShiftedOracle(DrafterConfig.for_target(tcfg, "eagle"), torch.zeros(V, H), head)
    wrong.bind(samples)
    assert ttt_forward(wrong, pack(samples), cfg).accuracy(0) < 0.3


def test_labels_are_the_target_greedy_token_two_ahead():
    """Step j at slot t is scored on token t+2+j: only response tokens inside the sample count."""
    tcfg = tiny_target_cfg(vocab_size=V, hidden_size=H)
    x, f = _sequence(10, 3)
    mask = torch.zeros(10, dtype=torch.bool)
    mask[6:] = True  # response = positions 6..9
    d = Oracle(DrafterConfig.for_target(tcfg, "eagle"), torch.zeros(V, H), _head())
    s = FeatureSample(x, mask, f)
    d.bind([s])
    st = ttt_forward(d, pack([s]), TTTConfig(steps=3))
    assert st.count == [4, 4, 4]  # slots 4..7, 3..6, 2..5
    s.loss_mask[:] = True  # now the sample end binds: t+2+j <= 9
    st = ttt_forward(d, pack([s]), TTTConfig(steps=3))
    assert st.count == [8, 7, 6]
    assert st.accuracy(0) == st.accuracy(2) == 1.0
