//! Durations as the agent's flags and the test harness's settings write them: a number
//! and a unit, `ms`, `s` or `m` (`1500ms`, `0.5s`, `2m`), or, where a caller allows it, a
//! bare number of seconds (`0.1`). One grammar for both: surrounding blanks, and blanks
//! between the number and its unit, are ignored; the number is a decimal (`.5`, `1.`,
//! `1e3` and `+1` included), not negative, not infinite, not NaN.

use std::time::Duration;

/// Whether a number without a unit is taken as seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bare {
    /// `60` is refused: the agent's flags, where a unit says what is meant.
    Refused,
    /// `60` is 60 s: the test harness's `ARG_*` settings, which have always taken it.
    Seconds,
}

/// A duration with its unit (`60s`, `1500ms`, `2m`; `0s` included), as the agent's flags
/// take it.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    parse(s, Bare::Refused)
}

/// [`parse_duration`], and a bare number is seconds (`0.1` is 100 ms).
pub fn parse_duration_or_seconds(s: &str) -> Result<Duration, String> {
    parse(s, Bare::Seconds)
}

/// The one parser behind both.
pub fn parse(s: &str, bare: Bare) -> Result<Duration, String> {
    let text = s.trim();
    let (number, scale) = [("ms", 1e-3), ("s", 1.0), ("m", 60.0)]
        .into_iter()
        .find_map(|(unit, scale)| Some((text.strip_suffix(unit)?, scale)))
        .unwrap_or((text, 1.0));
    let expected = match bare {
        Bare::Refused => "a number and a unit (ms, s, m), as in 60s",
        Bare::Seconds => "a number of seconds, or a number and a unit (ms, s, m), as in 0.1s",
    };
    let unitless = number.len() == text.len();
    if unitless && bare == Bare::Refused && text.parse::<f64>().is_ok() {
        return Err(format!("duration {s:?}: no unit; expected {expected}"));
    }
    let n: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("duration {s:?}: expected {expected}"))?;
    if n.is_sign_negative() {
        return Err(format!("duration {s:?}: negative"));
    }
    Duration::try_from_secs_f64(n * scale).map_err(|e| format!("duration {s:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(bare: Bare, text: &str, want: Result<u64, &str>) {
        let got = parse(text, bare);
        match want {
            Ok(ms) => assert_eq!(got, Ok(Duration::from_millis(ms)), "{text:?}"),
            Err(part) => {
                let e = got.expect_err(text);
                assert!(
                    e.contains(&format!("{text:?}")) && e.contains(part),
                    "{text:?}: {e}"
                );
            }
        }
    }

    #[test]
    fn every_accepted_form_with_a_unit_is_taken_by_both() {
        for bare in [Bare::Refused, Bare::Seconds] {
            for (text, ms) in [
                ("60s", 60_000),
                ("1500ms", 1500),
                ("2m", 120_000),
                ("0.5s", 500),
                (".5s", 500),
                ("1.s", 1000),
                ("0s", 0),
                ("100ms", 100),
                ("0.1s", 100),
                (" 2s ", 2000),
                ("2 s", 2000),
                ("1e3ms", 1000),
                ("+1s", 1000),
            ] {
                check(bare, text, Ok(ms));
            }
        }
    }

    #[test]
    fn a_bare_number_is_seconds_only_where_allowed() {
        for (text, ms) in [("1", 1000), ("0.1", 100), (" 2 ", 2000), ("0", 0)] {
            check(Bare::Seconds, text, Ok(ms));
            check(Bare::Refused, text, Err("no unit"));
        }
        assert_eq!(parse_duration("60s"), parse_duration_or_seconds("60"));
    }

    #[test]
    fn every_refused_form_is_refused_by_both_naming_the_text() {
        for bare in [Bare::Refused, Bare::Seconds] {
            for (text, why) in [
                ("", "expected"),
                ("   ", "expected"),
                ("s", "expected"),
                ("ms", "expected"),
                ("1h", "expected"),
                ("1.2.3s", "expected"),
                ("1 2s", "expected"),
                ("ten s", "expected"),
                ("-1s", "negative"),
                ("-0s", "negative"),
                ("infs", "too big or NaN"),
                ("NaNs", "too big or NaN"),
                ("1e30s", "too big or NaN"),
            ] {
                check(bare, text, Err(why));
            }
        }
        check(Bare::Refused, "-1", Err("no unit"));
        check(Bare::Seconds, "-1", Err("negative"));
    }
}
