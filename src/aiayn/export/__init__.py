"""The export layer: a trained checkpoint as a Hugging Face ``MarianMTModel`` folder
(:mod:`.marian`) and as a CTranslate2 model that translates through the engine (:mod:`.ctranslate2`)."""
