"""``python -m lconv.import_fairseq --checkpoint=model.pt --dict=dict.txt --spm=spm.model --workdir=runs/x``:
a fairseq translation checkpoint as an lconv workdir (``lconv.interop.fairseq_workdir``)."""
from lconv.interop.fairseq_workdir import main

if __name__ == "__main__":
    main()
