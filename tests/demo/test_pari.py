"""Math (demo.pari): the PARI/GP manual's TeX split into sections, macros unwrapped, formulas kept."""
from __future__ import annotations

from demo import pari


def test_pari_sections_and_detex_keep_formulas():
    tex = ("\\input parimacro\n\\chapter{Functions}\n\\section{Transcendental}\\label{se:trans}\n"
           "\\subsec{incgam$(s,x)$}\\kbdsidx{incgam}\nIncomplete gamma $\\int_x^\\infty e^{-t}\\,dt$, see \\kbd{gamma},"
           " returns a \\typ{REAL}; \\fun{GEN}{incgam}{GEN s, GEN x}.\n\\bprog\n? incgam(1,2)\n@eprog\\noindent Done.\n")
    sections = pari.split_tex_sections(tex)
    assert [section.split("\n")[0][:12] for section in sections] == ["\\chapter{Fun", "\\section{Tra", "\\subsec{incg"]
    text = pari.detex_pari(sections[2])
    assert text.startswith("incgam$(s,x)$\nIncomplete gamma $\\int_x^\\infty e^{-t}\\,dt$, see gamma, returns a t_REAL")
    assert "incgam(GEN s, GEN x)" in text and "? incgam(1,2)" in text
    assert "\\kbdsidx" not in text and "@eprog" not in text and "\\noindent" not in text
