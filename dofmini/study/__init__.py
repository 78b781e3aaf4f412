"""The study harness around the method: data store, tasks, evaluation, resumable stages, the
oracle, statistics and the report. The method itself (dofmini/*.py) imports nothing here."""
