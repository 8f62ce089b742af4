"""`ayumi demo`: the whole pipeline on real text, and the demo corpus it trains on.

What lives here (one module per source of text, the build above them, the run on top):

- `demo.run`: `ayumi demo` (corpus -> tokenizer -> shards -> plan -> train -> report), each stage
  through the owning package's own command (`tokenizer.cli`, `data.cli`, `pretrain.tools.plan`,
  `pretrain.tools.launch`, `pretrain.tools.report.build`); `ayumi demo corpus` is routed to `demo.corpus`;
- `demo.corpus`: `ayumi demo corpus`: the five domains, the build (sources in parallel, the
  ja_clean split, atomic output), the manifest and cache, the user's own JSONL (`--use`);
- `demo.cloze`: the cloze tasks scored while the demo trains: a few Japanese and English documents
  held out of the corpus before the tokenizer and data preparation read it, cut into examples;
- the sources, each turning one origin into `{"text", "source"}` documents:
  `demo.manpages` (ja_raw/ja_clean: Debian's manpages-ja rendered with groff, the quality filter),
  `demo.austen` (en: Jane Austen from r-cran-janeaustenr), `demo.pari` (math: the PARI/GP
  manual's TeX), `demo.python_code` (code: this Python's standard library);
- what the sources stand on: `demo.debian` (`apt-get download` + `dpkg-deb -x` into a cache),
  `demo.rdata` (R's XDR serialization and lazy-load databases, no R needed), `demo.base` (the
  errors, the progress callback).

May import: anything below it. The demo sits at the end of the data flow (common -> tokenizer -> data -> curriculum ->
pretrain -> demo). It may import any of those packages; the sources and the corpus build need only
`common` (and each other, downward: sources -> debian/rdata -> base); `demo.cloze` cleans text as
`data` does and imports nothing of the demo above `demo.base`. No other ayumi package
imports `demo`: `pretrain.tools.cli` names `demo.run` as a string and loads it only for `ayumi demo`
(tests/demo/test_layout.py checks both directions).
"""
