"""The model side of a run: the catalog of models yeto knows (`catalog`), getting one onto the disk (`materialize`),
what was really used (`provenance`: commits and digests) and the saved-adapter format a peft user loads (`adapter`)."""
