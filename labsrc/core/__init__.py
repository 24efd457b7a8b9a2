"""Infrastructure every lesson uses: rank context, launching, run records, profiles, progress, forked ranks, widgets."""
