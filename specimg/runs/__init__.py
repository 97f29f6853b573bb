"""Run folders: what ``generate``, ``bench`` and ``make-drafter-data`` write, owned by one
run at a time, fingerprinted, resumable (:mod:`.log`, :mod:`.folder`),
and the images they hold (:mod:`.images`)."""
