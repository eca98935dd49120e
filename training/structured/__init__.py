"""Budgeted structured prediction (paper 004): per-part feature acquisition.

The policy machinery is independent of any task:

* :mod:`training.structured.state` — the "parts x templates" state S ∈ {0,1}^{|parts| x K},
  its cost c(S) and its one-step transitions;
* :mod:`training.structured.chain` — a linear-chain predictor whose part scores are a sum of
  per-template contributions (Viterbi, forward-backward, brute force for the oracle tests);
* :mod:`training.structured.problem` — the protocol a task implements (losses of states,
  policy inputs) and its linear-chain implementation;
* :mod:`training.structured.policies` — pseudo-labels by greedy trajectory search, the
  one-shot policy (Thm 2.1/2.2), the anytime policy (Alg. 1 and 2) and the uniform and
  myopic baselines.

The OCR task (handwritten words, 16x8 letters) lives in :mod:`training.structured.ocr`.
"""
