"""What more than one study uses and the library does not: decode timings of trained models
side by side (`measure`) and figures against dense (`plots`). Not a study: no STUDY here."""
