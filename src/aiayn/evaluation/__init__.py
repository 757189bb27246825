"""The evaluation layer: from a trained checkpoint to translations (:class:`.translator.Translator`)
and their scores (``aiayn-eval``, ``aiayn-translate``). The scoring functions themselves are the leaf
:mod:`aiayn.scoring`, which training uses too."""
