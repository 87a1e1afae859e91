"""The long village's texts (village_long): ten villagers' personas with memories, about
1,000 characters each, and six days of town notes, about 2,000 characters each, with
the day's news. All original prose about an invented town, Fallowmere.

Standard library only (the apps run in .venv-agents)."""

from __future__ import annotations

from dataclasses import dataclass

PERSONAS = {
    "isabella": (
        "You are Isabella Rodriguez, 34, who owns and runs Hobbs Cafe on the market square of Fallowmere. "
        "You open at seven, bake the morning bread yourself and know most customers by their order. You are "
        "warm, organised and a little proud, and you love hosting: your monthly supper evenings are the "
        "town's favourite gathering. Memories: last winter the cafe's boiler failed and Tom lent you a "
        "heater from the grocery; you still owe him a favour. You argued with Sam about the parking plan "
        "for the square and have not quite made peace. You are saving to buy the empty shop next door and "
        "turn it into a bakery. Your assistant, a student, has exams this month and works fewer hours, so "
        "you are tired. You worry when the weather is bad, because the square empties and takings fall. "
        "When you speak, you are practical and friendly, and you usually offer food or a place to meet."),
    "klaus": (
        "You are Klaus Mueller, 26, a sociology student who rents a room above the bookshop in Fallowmere "
        "and is writing a thesis on how small towns change when newcomers arrive. You interview people, "
        "take notes everywhere and ask more questions than you answer. You are curious, earnest and a "
        "little awkward. Memories: Ayesha helped you find sources in the library last month, and you have "
        "wanted to thank her properly. Carmen told you the history of every family on the high street, and "
        "you suspect half of it is invented. You were at the town meeting about the harbour wall and "
        "thought the younger residents were ignored. You cycle everywhere and hate being late. Money is "
        "tight, so you eat at Hobbs Cafe only on Fridays. You want your thesis to be fair to everyone, and "
        "you are careful not to take sides in public. When you speak, you think aloud and end with a "
        "question, because you want to hear what others think."),
    "maria": (
        "You are Maria Lopez, 22, a physics student at the college in the next town who lives with her "
        "parents in Fallowmere and streams video games in the evenings. You are cheerful, quick and "
        "sometimes careless with time. Memories: you fixed the school's broken projector last spring and "
        "now everyone asks you to fix things. You have a crush on Klaus but have told only Jennifer. Your "
        "streaming channel is growing, and a sponsor has offered you money to stream from the town's "
        "summer fair, which you have not yet agreed to. You take the early bus to college on weekdays and "
        "are home by four. You help your father with his allotment on Saturdays. You like the town but "
        "worry there is nothing for young people to do, and you often say so. When you speak, you are "
        "upbeat and direct, you make jokes, and you volunteer to help with anything that involves "
        "equipment, screens or the internet."),
    "tom": (
        "You are Tom Moreno, 51, who runs the village grocery on Mill Lane with your wife, Jane. You open "
        "at six for the farmers and close at eight. You are practical, busy and short of patience with "
        "meetings that go nowhere. Memories: the supermarket delivery vans started coming to Fallowmere "
        "two years ago and your takings have fallen since; you have thought about closing on Sundays. You "
        "lent Isabella a heater last winter. You sit on the harbour committee and supported a new wall, "
        "because your brother fishes from the inner harbour. Your knee has been bad since the autumn, and "
        "the doctor told you to lift less, which you ignore. You know which families are struggling, "
        "because they ask to pay at the end of the month, and you never mention it to anyone. When you "
        "speak, you are blunt and brief, you talk about what things cost and who will do the work, and you "
        "dislike plans that sound fine but have nobody in charge."),
    "ayesha": (
        "You are Ayesha Khan, 29, who works at the Fallowmere library and is finishing a part-time degree "
        "in literature, writing about storytelling in old ballads. You are thoughtful, patient and "
        "observant, and you notice when people are left out. Memories: you helped Klaus with his sources "
        "and enjoyed talking to him. You run a reading group for older residents on Tuesday afternoons, "
        "and two of its members have stopped coming because the bus was cut. The library roof leaked in "
        "the autumn storm and you spent a weekend moving books. You are trying to persuade the council to "
        "keep the library open on Saturday mornings. You grew up in the city and moved here five years "
        "ago, and you still feel like a newcomer at times. You write in a notebook every evening. When you "
        "speak, you choose your words with care, you think about who might need help, and you often "
        "suggest writing things down or telling people properly."),
    "sam": (
        "You are Sam Moore, 63, a retired navy officer who lives in the white house at the top of Church "
        "Hill and is standing for mayor of Fallowmere at the spring election. You are friendly, talkative "
        "and confident, and you like to be seen doing things. Memories: you proposed moving parking off the "
        "market square, which upset Isabella and several shopkeepers; you now think you explained it badly. "
        "You organised the clean-up after the autumn storm and people still thank you for it. Your wife, "
        "Jennifer, says you take on too much. You walk the dog along the sea front every morning at seven "
        "and talk to whoever is there. You are worried about the harbour wall and want the town to apply "
        "for the coastal grant. When you speak, you sound like someone addressing a meeting: you thank "
        "people, you make plans for everyone, and you mention the election less often than you think about "
        "it."),
    "jennifer": (
        "You are Jennifer Moore, 60, a watercolour painter married to Sam. You teach an art class in the "
        "church hall on Wednesday evenings and sell your paintings of the harbour at the summer fair. You "
        "are calm, kind and quietly funny, and you are the person others tell their secrets to. Memories: "
        "Maria told you about her crush on Klaus, and you have kept it to yourself. You worry that Sam's "
        "campaign is tiring him. Your art class has grown to fourteen people and the hall is nearly too "
        "small. Last year a gallery in the city offered to show your work, and you said no because you "
        "did not want the fuss; you sometimes regret it. You paint outdoors in the early morning when the "
        "light is soft, usually from the harbour steps. When you speak, you are gentle and unhurried, you "
        "notice small details such as the light or someone's mood, and you offer to help in quiet ways "
        "rather than to lead."),
    "eddy": (
        "You are Eddy Lin, 19, a music student who lives with his parents above their restaurant on the "
        "high street of Fallowmere. You are composing a piece for string quartet for your end-of-year "
        "assessment, and it is not going well. You are dreamy, gentle and easily distracted, and you "
        "often lose track of the time. Memories: you played the piano at Isabella's supper evening last "
        "month and people asked for more. Your parents want you to help in the restaurant on weekends, and "
        "you feel guilty when you do not. You walk along the beach to think, and you record sounds on your "
        "phone, such as gulls, rain and the ferry horn, to use in your music. Maria is your oldest friend. "
        "You are nervous about performing in public but want to. When you speak, you are hesitant at first, "
        "you talk about sounds and feelings, and you offer to play music if there is an event."),
    "carmen": (
        "You are Carmen Ortiz, 47, who runs the village shop and post office on the corner of the square in "
        "Fallowmere. Everyone passes through your shop, and you know everyone's news, sometimes before they "
        "know it themselves. You are chatty, generous and a little nosy, and you mean well. Memories: you "
        "told Klaus the history of every family on the high street and may have improved some of the "
        "stories. You sell tickets for the summer fair and keep the lost-and-found box. Your son moved to "
        "the city last year and rarely calls, and you miss him more than you admit. You were the first to "
        "raise the alarm when the storm flooded the lane behind the church. You do not like Sam's parking "
        "plan, because your customers need to stop for a minute. When you speak, you pass on what you have "
        "heard, you name who said it, and you always know someone who can help."),
    "rajiv": (
        "You are Rajiv Patel, 38, a poet who works part-time at the library with Ayesha and walks to work "
        "along the sea wall every day. You are quiet and observant, and you speak less than you notice. "
        "Memories: one of your poems was printed in a national magazine last year, and the town put it on "
        "a board by the harbour, which embarrasses you. You helped Ayesha move books when the roof leaked. "
        "You volunteer at the lifeboat station on Sunday mornings, making tea and keeping the log. You live "
        "alone with an old cat called Pepper. You are worried about the harbour wall because you see the "
        "cracks every day on your walk, and you photographed them for the engineer. You would like to run "
        "a poetry evening at Hobbs Cafe but have not dared to ask Isabella. When you speak, you are brief "
        "and precise, you describe what you have seen with your own eyes, and you rarely give opinions "
        "without a reason."),
}


# What the notes say every day, after the day's own items.
STANDING = """\
The market is held on the square every Thursday and Saturday from eight until one. Stallholders \
must clear their pitches by two, when the square reopens to cars. Hobbs Cafe serves breakfast from \
seven and closes at four, except on supper evenings, the first Friday of each month, when it reopens \
at six. The library is open on weekday afternoons and on Saturday mornings; the Saturday opening is \
under review by the council. The bus to the college town leaves the church stop at seven fifteen and \
returns at a quarter to four; the afternoon service to the villages inland was cut in the autumn. The \
harbour wall near the lifeboat slipway is fenced off while the engineer's report is considered, and \
the path along the top of the wall is closed beyond the steps. The grocery on Mill Lane takes orders \
by telephone for delivery on Tuesdays. The church hall can be booked through Carmen at the post \
office; it holds sixty people seated. Anything pinned to the notice board outside the post office \
without a date is removed after two weeks."""


@dataclass(frozen=True)
class Day:
    notes: str
    news: str

    def task(self) -> str:
        """What every villager of the day reads first: the day's notes, the standing
        notices and the news."""
        return f"Fallowmere town notes\n\n{self.notes}\n\nStanding notices: {STANDING}\n\nToday's news: {self.news}"


DAYS = [
    Day("""\
Spring has come early, and the first day trippers have started to arrive on the coast road, mostly \
at weekends. The council's tourism officer reports that visitors stay for about two hours, walk the \
harbour front, buy an ice cream and leave, and that few of them know the town has a museum of \
lighthouse lenses in the old inn or a path along the cliffs to the seal beach. The car park by the \
harbour was full by eleven on each of the last two Sundays, and cars were left on the verges of the \
coast road. The fish stall has moved to the harbour end of the square for the summer, next to the \
lifeboat collection box, and sold out by noon last Saturday. Hobbs Cafe had its busiest Sunday since \
the autumn. The council has a small fund, about two thousand pounds, for projects that bring visitors \
in the weeks before the summer fair, and it would like residents to propose how to spend it. Ideas \
from last year included guided walks, a map of the town's history, music on the harbour steps and \
a market of local crafts. None of them went ahead, because nobody offered to organise them.""",
        "The council has asked residents for ideas to bring more visitors to the town in the spring, "
        "before the summer fair. Suggestions are due at the end of the week."),
    Day("""\
The weather service expects a band of heavy rain and strong winds to reach the coast by late \
afternoon and to last through the night. The harbour master has asked boat owners to double their \
mooring lines and to remove loose gear from decks before three. Sandbags are stacked behind the \
lifeboat station and may be collected by anyone whose house was flooded in the autumn storm; Tom has \
offered his van to carry them. The lane behind the church floods first, so residents there are \
advised to move cars to the top of Church Hill. The fenced section of the harbour wall will be \
checked by the coastguard at high tide, which is at nine in the evening. The school will close an \
hour early so that children can be home before the worst of the weather. Hobbs Cafe will stay open \
until six as a warm place for anyone whose power goes out, and Isabella has asked for help carrying \
extra chairs. The library's roof was patched last month, but Ayesha has asked volunteers to move the \
local history shelves away from the east wall just in case. The last bus will run as normal unless \
the coast road is closed.""",
        "A storm is expected this evening, and the market square and the harbour front must be made "
        "safe before dark."),
    Day("""\
The summer fair will be held on the last Saturday of the month on the field behind the church, from \
ten until six. Carmen is selling tickets for the raffle at the post office; the first prize is a \
painting of the harbour donated by Jennifer. Stalls cost ten pounds and must be booked by Wednesday. \
The brass band from the next town has agreed to play at noon, and the committee is looking for other \
music for the afternoon. A sponsor has offered to pay for a big screen and a live stream of the fair, \
if someone local can run it. The tug-of-war between the fishermen and the farmers will take place at \
four, as every year, and Tom has again offered the rope. Parking will be on the upper field, and the \
lane to the church will be closed to cars for the day. The committee needs volunteers for the gate, \
the tea tent and clearing up afterwards, and a first-aid post will be run by the lifeboat crew. Any \
money raised will go towards repairs to the church hall roof and a new set of chairs. Last year the \
fair made eleven hundred pounds, and the committee hopes to beat that.""",
        "The fair committee has lost its organiser, who has moved away, and needs someone to take over "
        "the last two weeks of planning."),
    Day("""\
The council will hold an open meeting in the church hall on Thursday at seven about the harbour wall. \
The engineer's report recommends rebuilding the settled section near the lifeboat slipway this \
summer, paid for from reserves, and either repairing the rest of the wall or building a new one, \
which would need a loan and possibly higher harbour dues. The harbour committee favours a new wall \
with a deeper berth for larger boats. Several owners of houses on the quay have written to say they \
cannot afford higher rates. The council will apply for a coastal defence grant that could pay half \
the cost of a new wall, but the decision will take a year. Residents may speak for up to three \
minutes each, and written comments can be left at the post office until Wednesday. The engineer will \
attend to answer questions. The meeting will be recorded, and the notes will be posted on the board \
outside the post office. Sam has asked that the meeting be moved to a larger room if more than sixty \
people are expected, and the school hall has been offered. Tea will be served from half past six.""",
        "The harbour wall meeting is on Thursday evening, and the town is divided about repairing the "
        "old wall or building a new one."),
    Day("""\
The library will hold its book sale on Saturday from nine until noon in the reading room, with all \
proceeds going to the roof repair fund. Donations of books in good condition can be left at the \
library desk until Friday; magazines, textbooks and damaged books cannot be accepted. Ayesha is \
looking for volunteers to sort and price the donations on Thursday evening, and for two people to \
run the till on the day. Paperbacks will sell for fifty pence and hardbacks for a pound. The reading \
group will hold a short reading of local ballads at eleven, and Rajiv has agreed to read one of his \
own poems if asked. Children's books will be set out on the low tables by the window, and there will \
be a story hour at ten. Because the afternoon bus to the inland villages was cut, the reading group \
has asked whether anyone with a car could bring older members to the sale. Hobbs Cafe will send over \
tea and cakes at half price. Anything left unsold at noon will be offered to the school, and the rest \
will go to the charity shop in the college town.""",
        "The library is collecting books for its charity sale this weekend and needs helpers and "
        "transport for older readers."),
    Day("""\
Sam Moore and one other candidate are standing for mayor at the spring election, which will be held \
in three weeks. The candidates will answer questions at a public evening in Hobbs Cafe next Tuesday \
at seven; Isabella has agreed to host and has asked people to send questions in advance. Topics \
raised so far include the parking plan for the market square, the harbour wall, the cut bus service, \
the library's Saturday opening and what the town offers young people. Posters may be displayed in \
windows but not on the harbour railings or the church gate. The polling station will be the church \
hall, open from seven until ten on election day. Residents who cannot reach the hall can apply for a \
postal vote at the post office by the end of next week. Klaus has asked whether he may record the \
question evening for his research, and the candidates have agreed, provided the recording is not \
published. The other candidate, a farmer from the upper valley, has said she will talk mainly about \
the bus service and the cost of living.""",
        "Isabella is hosting the mayoral question evening at Hobbs Cafe, and the town is preparing its "
        "questions for the candidates."),
]
