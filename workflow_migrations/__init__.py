"""The yoyo migration chain of pgworkflow's two tables, applied by `workflow.store.migrate`.

Files are numbered `0001_...`, `0002_...`; a release only adds (expand), a drop
lands one release later (contract).
"""
