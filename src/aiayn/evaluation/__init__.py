"""The evaluation layer: from a trained checkpoint to translations (:class:`.translator.Translator`,
``aiayn-translate``) and to their scores, the files that hold them and the comparison of two systems
(:func:`.evaluate.evaluate`, ``aiayn-eval``). The scoring functions themselves are the leaf
:mod:`aiayn.scoring`, which training uses too."""
