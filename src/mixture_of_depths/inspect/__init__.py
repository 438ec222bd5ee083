"""Where the compute went, token by token: the numbers behind `mod inspect`.

`analyse(model, tokens)` runs one forward pass in causal routing (what generation does) and one in
top-k routing over the same rows and reports, per token, which routed (sub-)blocks it took, the
router weights, the model's predictive entropy and its loss; and over all tokens:

- the histogram of blocks taken per token, beside the histogram routing would give if each
  router flipped an independent coin at its own take-rate (a Poisson-binomial distribution);
- the longest run of consecutive skipped routers of each token (in layer order), its
  distribution, and the mean loss by run length;
- Spearman's rho of blocks taken against entropy and against loss, with percentile bootstrap
  intervals over rows (each drawn whole);
- how often the causal decision and top-k agree, per router;
- with a `baseline` model (a dense twin trained on the same tokens), each token's excess loss
  (this model's minus the baseline's): a skipper's low loss alone cannot say skipping was free,
  because the router picks which tokens skip; the baseline tells what they would have cost.

`stats` holds the statistics, `analysis` the forward passes and tables, `plots` the pictures and
`report` the markdown and the page; everything is computed with torch on the host.
"""

from .analysis import (
    BYTE_CLASSES,
    TEXT_CLASSES,
    Report,
    analyse,
    byte_class,
    class_table,
    extremes,
    interval_text,
    loss_by,
    loss_by_run,
    rho_text,
    text_class,
    undefined_reason,
    variance_ratio_text,
)
from .plots import PICTURES, plot
from .report import html_page, report_json, report_md
from .stats import (
    bootstrap_spearman,
    independence_test,
    longest_run,
    mean_interval,
    poisson_binomial,
    ranks,
    spearman,
)

__all__ = [
    "BYTE_CLASSES",
    "PICTURES",
    "TEXT_CLASSES",
    "Report",
    "analyse",
    "bootstrap_spearman",
    "byte_class",
    "class_table",
    "extremes",
    "html_page",
    "independence_test",
    "interval_text",
    "longest_run",
    "loss_by",
    "loss_by_run",
    "mean_interval",
    "plot",
    "poisson_binomial",
    "ranks",
    "report_md",
    "report_json",
    "rho_text",
    "spearman",
    "text_class",
    "undefined_reason",
    "variance_ratio_text",
]
