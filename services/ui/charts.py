"""Chart colours shared by the pages, so a cache source looks the same everywhere."""

from __future__ import annotations

import altair as alt

COLD, MEMORY, DISK = "#d62728", "#1f77b4", "#2ca02c"

# cache_source of a request: none (cold prefill) | memory | disk
SOURCE_SCALE = alt.Scale(domain=["none", "memory", "disk"], range=[COLD, MEMORY, DISK])
# cold = cache_source none, warm = memory or disk
KIND_SCALE = alt.Scale(domain=["cold", "warm"], range=[COLD, MEMORY])
