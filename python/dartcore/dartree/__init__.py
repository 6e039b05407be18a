"""DARTree tree builders: a Markov correction head over the drafter's top-K candidates,
a depth-wise batched supertree and one deferred global top-B (``tree="dartree"``), the same
with the n-gram term of Eq. (10) (``tree="hybrid"``), and DDTree's best-first tree over the
raw marginals (``tree="ddtree"``). See docs/architecture.md, "DARTree"."""

from dartcore.dartree.head import CorrectionHead
from dartcore.dartree.supertree import NgramTerm, Supertree, build_supertree, select_top_b

__all__ = ["CorrectionHead", "NgramTerm", "Supertree", "build_supertree", "select_top_b"]
